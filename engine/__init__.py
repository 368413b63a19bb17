from engine.kernels.isa import check_isa_env

check_isa_env()  # before _kernels loads and reads the cap
