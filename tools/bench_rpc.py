"""Round trip of one MoE layer's request to workers on loopback: the framed TCP links the cluster uses
(one socket per worker, colibri_stream/experts/cluster/transport.py) vs torch.distributed gloo in one
group (the transport before issue #43) vs Ray, one run.

    python tools/bench_rpc.py [--kib 14] [--calls 2000] [--workers 2] [--dim 7168] [--rounds 3]  # Ray: pip install ray
    python tools/bench_rpc.py --auth [--calls 2000] [--rounds 3]  # authenticated links only (issue #70)

"--auth": the candidates for links only the cluster's processes can use, per MoE layer as above against
today's link (socket_per_worker, unsealed): socket_sealed_per_worker (the same Link after the cluster key
handshake: every frame carries one AES-GCM tag over head and payload, auth.py; what #70 chose), zmq_curve_per_worker
(pyzmq PAIR sockets with CURVE, libsodium's Curve25519 + XSalsa20-Poly1305, and ZMQ_MAXMSGSIZE; needs
pyzmq importable) and tls_per_worker (Python's ssl, TLS 1.3 with a self-signed certificate pinned by the
client; needs `cryptography` to make the certificate). Each runs in its own processes, which a 2-core host
places differently run to run (the same contender's medians 42 or 88 us apart), so "interleaved" also
times today's link and the sealed one over the same links, alternating call by call, in --rounds fresh
sets of processes: "sealed_vs_plain" is the ratio of medians in each, both on the same placement.

"layer" numbers: per MoE layer the coordinator sends each of --workers workers one request (a token's
activations at --dim, bf16, plus ids and weights) and waits for every float64 [1, dim] partial sum:
gloo_one_group (isend/irecv in one group of workers + 1, the transport before #43), gloo_group_per_worker
(the coordinator and each worker in a group of their own: new_group([0, w]), so a timeout closes only that
pair's group) vs socket_per_worker (the cluster's own Link frames, what #43 chose). "regroup_ms": the
median time to form a fresh gloo group of all the processes (new_group over the store, every pair
connected): what the "fresh group with the survivors" arrangement would pay at every loss and rejoin.

Issue #19 shards experts over workers: per MoE layer the coordinator sends each worker the batch's
activations (one token at DeepSeek-V3's width: 7168 bf16 values, 14 KiB) and takes back the partial
sum of the same size. What decides the engine is that round trip, paid once per MoE layer per token
(58 layers for V3). Both contenders echo a tensor of --kib KiB between two processes on 127.0.0.1:
gloo with blocking send/recv of a CPU tensor, Ray with an actor method called through ray.get. Each
number is the median (and p90) of --calls round trips after a warm-up; they run one after the other
on the same machine, so the ratio is the number to read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colibri_stream.experts.cluster.auth import COORDINATOR_ROLE, WORKER_ROLE, Seal
from colibri_stream.experts.cluster.transport import Link, Reply, dial
from colibri_stream.experts.cluster.wire import HEAD, Op

MOE_LAYERS_V3 = 58
WARMUP = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, values: int, calls: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.zeros(values)
    times = []
    for i in range(WARMUP + calls):
        if rank == 1:  # the worker: receive the activations, send a partial sum back
            dist.recv(x, src=0)
            dist.send(x, dst=0)
            continue
        start = time.perf_counter()
        dist.send(x, dst=1)
        dist.recv(x, src=1)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out["times"] = times
    dist.destroy_process_group()


def gloo_round_trips(values: int, calls: int) -> list[float]:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gloo_worker, args=(_free_port(), values, calls, out), nprocs=2, join=True)
        return list(out["times"])


def _layer_request(dim: int) -> torch.Tensor:
    """One token's request payload: 8 ids, 8 weights, activations [1, dim] bf16 (as bytes)."""
    return torch.zeros(8 * 8 + 8 * 4 + dim * 2, dtype=torch.uint8)


REGROUPS = 5


def _regroup_times(workers: int) -> list[float]:
    """Seconds to form a fresh group of every process, REGROUPS times (all ranks call it, in order)."""
    times = []
    for _ in range(REGROUPS):
        dist.barrier()
        start = time.perf_counter()
        group = dist.new_group(list(range(workers + 1)))
        dist.barrier(group=group)  # gloo connects the pairs lazily on some versions: use it once
        times.append(time.perf_counter() - start)
    return times


def _gloo_layer(rank: int, port: int, workers: int, dim: int, calls: int, per_worker: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=workers + 1)
    # per worker: one group {0, w} each (every rank takes part in forming each one, in the same order)
    groups = [dist.new_group([0, w]) for w in range(1, workers + 1)] if per_worker else [None] * workers
    request, reply = _layer_request(dim), torch.zeros(dim, dtype=torch.float64)
    times = []
    for i in range(WARMUP + calls):
        if rank:
            dist.recv(request, src=0, group=groups[rank - 1])
            dist.send(reply, dst=0, group=groups[rank - 1])
            continue
        start = time.perf_counter()
        replies = [torch.empty(dim, dtype=torch.float64) for _ in range(workers)]
        sends = [dist.isend(request, dst=w, group=groups[w - 1]) for w in range(1, workers + 1)]
        works = [dist.irecv(replies[w - 1], src=w, group=groups[w - 1]) for w in range(1, workers + 1)]
        for work in sends + works:
            work.wait()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    regroup = [] if per_worker else _regroup_times(workers)
    if rank == 0:
        out["times"], out["regroup"] = times, regroup
    dist.destroy_process_group()


def gloo_layer_round_trips(workers: int, dim: int, calls: int, per_worker: bool) -> tuple[list[float], list[float]]:
    """(round trips, times to form a fresh group of all; [] per worker)."""
    with mp.Manager() as manager:
        out = manager.dict()
        args = (_free_port(), workers, dim, calls, per_worker, out)
        mp.spawn(_gloo_layer, args=args, nprocs=workers + 1, join=True)
        return list(out["times"]), list(out["regroup"])


BENCH_KEY, NONCES = b"k" * 64, (b"w" * 32, b"c" * 32)  # fixed: the handshake is not what is timed


def _socket_worker(index: int, port: int, dim: int, calls: int, sealed: bool = False) -> None:
    link = dial("127.0.0.1", port, 60.0, "the coordinator")
    if sealed:
        link.seal = Seal.for_side(BENCH_KEY, WORKER_ROLE, *NONCES)
    reply = torch.zeros(dim, dtype=torch.float64).numpy().tobytes()
    for _ in range(WARMUP + calls):
        link.receive(None, "request", 1 << 20)
        link.send(Op.SUM, [reply], (), None)
    link.close()


def _links_to_workers(target, workers: int, *args) -> tuple[socket.socket, list, list[Link]]:
    """A listening socket, ``workers`` spawned processes running ``target(w, port, *args)`` and the
    coordinator's Link to each."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    context = mp.get_context("spawn")
    processes = [context.Process(target=target, args=(w, port, *args)) for w in range(workers)]
    for process in processes:
        process.start()
    return server, processes, [Link(server.accept()[0], f"worker {w}") for w in range(workers)]


def _one_layer(links: list[Link], request: bytes, dim: int) -> float:
    """One MoE layer's round trip in seconds: the request to every worker, then every partial sum back."""
    start = time.perf_counter()
    replies = [Reply(Op.SUM, torch.empty(dim, dtype=torch.float64), "layer") for _ in links]
    for link, reply in zip(links, replies, strict=True):
        link.send(Op.SUM, [request], (1, 1, 8, dim), 10.0, reply)
    for link, reply in zip(links, replies, strict=True):
        link.wait(reply, 10.0)
    return time.perf_counter() - start


def _finish(server: socket.socket, processes: list) -> None:
    for process in processes:
        process.join()
    server.close()


def socket_layer_round_trips(workers: int, dim: int, calls: int, sealed: bool = False) -> list[float]:
    server, processes, links = _links_to_workers(_socket_worker, workers, dim, calls, sealed)
    for link in links:
        link.seal = Seal.for_side(BENCH_KEY, COORDINATOR_ROLE, *NONCES) if sealed else None
    request = _layer_request(dim).numpy().tobytes()
    times = [_one_layer(links, request, dim) for _ in range(WARMUP + calls)][WARMUP:]
    _finish(server, processes)
    return times


def _interleaved_worker(index: int, port: int, dim: int, calls: int) -> None:
    link = dial("127.0.0.1", port, 60.0, "the coordinator")
    seal = Seal.for_side(BENCH_KEY, WORKER_ROLE, *NONCES)
    reply = torch.zeros(dim, dtype=torch.float64).numpy().tobytes()
    for i in range(2 * (WARMUP + calls)):
        link.seal = seal if i % 2 else None  # the coordinator alternates the same way
        link.receive(None, "request", 1 << 20)
        link.send(Op.SUM, [reply], (), None)
    link.close()


def interleaved_layer_round_trips(workers: int, dim: int, calls: int) -> tuple[list[float], list[float]]:
    """(plain, sealed) round trips per layer over the same links, alternating call by call: both see the
    same processes on the same cores (separate runs of 2-3 processes on 2 cores land 42 or 88 us apart)."""
    server, processes, links = _links_to_workers(_interleaved_worker, workers, dim, calls)
    seals = [Seal.for_side(BENCH_KEY, COORDINATOR_ROLE, *NONCES) for _ in links]
    request = _layer_request(dim).numpy().tobytes()
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(2 * (WARMUP + calls)):
        sealed = i % 2
        for link, seal in zip(links, seals, strict=True):
            link.seal = seal if sealed else None
        took = _one_layer(links, request, dim)
        if i >= 2 * WARMUP:
            times[sealed].append(took)
    _finish(server, processes)
    return times


def _zmq_worker(index: int, port: int, dim: int, calls: int, server_public: bytes) -> None:
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = server_public
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
    sock.connect(f"tcp://127.0.0.1:{port}")
    reply = bytes(HEAD.size) + torch.zeros(dim, dtype=torch.float64).numpy().tobytes()
    for _ in range(WARMUP + calls):
        sock.recv(copy=False)
        sock.send(reply, copy=False)
    sock.close(linger=1000)
    context.term()


def zmq_layer_round_trips(workers: int, dim: int, calls: int) -> list[float] | None:
    """One CURVE-authenticated PAIR socket per worker, the coordinator the CURVE server of each."""
    try:
        import zmq
    except ImportError:
        return None
    context = zmq.Context()
    public, secret = zmq.curve_keypair()
    socks, processes = [], []
    spawn = mp.get_context("spawn")
    for w in range(workers):
        sock = context.socket(zmq.PAIR)
        sock.curve_server, sock.curve_secretkey = True, secret
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        socks.append(sock)
        processes.append(spawn.Process(target=_zmq_worker, args=(w, port, dim, calls, public)))
        processes[-1].start()
    request = bytes(HEAD.size) + _layer_request(dim).numpy().tobytes()
    times = []
    for i in range(WARMUP + calls):
        start = time.perf_counter()
        for sock in socks:
            sock.send(request, copy=False)
        replies = [torch.frombuffer(sock.recv(copy=False).buffer[HEAD.size :], dtype=torch.float64) for sock in socks]
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
        del replies
    for process in processes:
        process.join()
    for sock in socks:
        sock.close(linger=0)
    context.term()
    return times


def _tls_certificate(directory: str) -> tuple[str, str] | None:
    """(certificate, key) files of a fresh self-signed P-256 certificate, or None without `cryptography`."""
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        return None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "colibri-cluster")])
    now = datetime.datetime.now(datetime.UTC)
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
    builder = builder.serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
    cert = builder.sign(key, hashes.SHA256())
    cert_file, key_file = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_file, "wb") as out:
        out.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_file, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))  # fmt: skip
    return cert_file, key_file


def _recv_exact(sock, n: int, out: bytearray) -> None:
    view, got = memoryview(out), 0
    while got < n:
        got += sock.recv_into(view[got:n])


def _tls_worker(index: int, port: int, dim: int, calls: int, cert_file: str) -> None:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cert_file)  # the pinned certificate is the only trusted one
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock = context.wrap_socket(raw, server_hostname="colibri-cluster")
    request = bytearray(HEAD.size + _layer_request(dim).numel())
    reply = bytes(HEAD.size) + torch.zeros(dim, dtype=torch.float64).numpy().tobytes()
    for _ in range(WARMUP + calls):
        _recv_exact(sock, len(request), request)
        sock.sendall(reply)
    sock.close()


def tls_layer_round_trips(workers: int, dim: int, calls: int) -> list[float] | None:
    import ssl
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        files = _tls_certificate(directory)
        if files is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(*files)
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        spawn = mp.get_context("spawn")
        processes = [spawn.Process(target=_tls_worker, args=(w, port, dim, calls, files[0])) for w in range(workers)]
        for process in processes:
            process.start()
        socks = []
        for _ in range(workers):
            conn = server.accept()[0]
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(context.wrap_socket(conn, server_side=True))
        request = bytes(HEAD.size) + _layer_request(dim).numpy().tobytes()
        reply = bytearray(HEAD.size + dim * 8)
        times = []
        for i in range(WARMUP + calls):
            start = time.perf_counter()
            for sock in socks:
                sock.sendall(request)
            for sock in socks:
                _recv_exact(sock, len(reply), reply)
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        for process in processes:
            process.join()
        for sock in socks:
            sock.close()
        server.close()
        return times


def _auth_rounds(workers: int, dim: int, calls: int, rounds: int) -> dict:
    """Today's link and the authenticated candidates, alternated ``rounds`` times (best round of each)."""
    contenders = {
        "socket_per_worker": lambda: socket_layer_round_trips(workers, dim, calls),
        "socket_sealed_per_worker": lambda: socket_layer_round_trips(workers, dim, calls, sealed=True),
        "zmq_curve_per_worker": lambda: zmq_layer_round_trips(workers, dim, calls),
        "tls_per_worker": lambda: tls_layer_round_trips(workers, dim, calls),
    }
    runs: dict[str, list[list[float]]] = {name: [] for name in contenders}
    out: dict = {}
    for _ in range(rounds):
        for name, run in contenders.items():
            times = run()
            if times is None:
                out[name] = "not installed"
            else:
                runs[name].append(times)
    base = None
    for name, rounds_of in runs.items():
        if not rounds_of:
            continue
        medians = [statistics.median(times) for times in rounds_of]
        best = summary(rounds_of[medians.index(min(medians))])
        assert best is not None
        out[name] = {**best, "round_medians_us": [round(m * 1e6, 1) for m in medians]}
        base = base or best["median_us"]
        out[name]["vs_today"] = round(best["median_us"] / base, 2)
    out["interleaved"] = _interleaved_rounds(workers, dim, calls, rounds)
    return out


def _interleaved_rounds(workers: int, dim: int, calls: int, rounds: int) -> dict:
    """Today's link vs the sealed one alternating call by call, ``rounds`` fresh sets of processes: the
    sealed/plain ratio of medians per round (each round's two contenders on the same placement)."""
    ratios, plain_us, sealed_us = [], [], []
    for _ in range(rounds):
        plain, sealed = interleaved_layer_round_trips(workers, dim, calls)
        plain_us.append(round(statistics.median(plain) * 1e6, 1))
        sealed_us.append(round(statistics.median(sealed) * 1e6, 1))
        ratios.append(round(sealed_us[-1] / plain_us[-1], 3))
    return {
        "plain_median_us": plain_us,
        "sealed_median_us": sealed_us,
        "sealed_vs_plain": ratios,
        "sealed_vs_plain_median": round(statistics.median(ratios), 2),
    }


def ray_round_trips(values: int, calls: int) -> list[float] | None:
    try:
        import ray
    except ImportError:
        return None

    @ray.remote
    class Worker:
        def partial_sum(self, x):
            return x

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = Worker.remote()
        x = torch.zeros(values).numpy()
        times = []
        for i in range(WARMUP + calls):
            start = time.perf_counter()
            ray.get(worker.partial_sum.remote(x))
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        return times
    finally:
        ray.shutdown()


def summary(times: list[float] | None) -> dict | None:
    if times is None:
        return None
    ordered = sorted(times)
    median = statistics.median(ordered)
    return {
        "median_us": round(median * 1e6, 1),
        "p90_us": round(ordered[int(0.9 * len(ordered))] * 1e6, 1),
        "ms_per_token_v3": round(median * MOE_LAYERS_V3 * 1e3, 2),  # one round trip per MoE layer
    }


def _layer_rounds(workers: int, dim: int, calls: int, rounds: int) -> dict:
    """The three layer contenders, alternated ``rounds`` times: each one's round with the lowest median
    (a shared box's other load lands on one round or another), every round's median, the regroup time."""
    runs: dict[str, list[list[float]]] = {"gloo_one_group": [], "gloo_group_per_worker": [], "socket_per_worker": []}
    regroup: list[float] = []
    for _ in range(rounds):
        one_group, formed = gloo_layer_round_trips(workers, dim, calls, per_worker=False)
        runs["gloo_one_group"].append(one_group)
        regroup += formed
        runs["gloo_group_per_worker"].append(gloo_layer_round_trips(workers, dim, calls, per_worker=True)[0])
        runs["socket_per_worker"].append(socket_layer_round_trips(workers, dim, calls))
    out: dict = {}
    for name, rounds_of in runs.items():
        medians = [statistics.median(times) for times in rounds_of]
        best = summary(rounds_of[medians.index(min(medians))])
        assert best is not None
        out[name] = {**best, "round_medians_us": [round(m * 1e6, 1) for m in medians]}
    out["regroup_ms_median"] = round(statistics.median(regroup) * 1e3, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kib", type=float, default=14.0, help="payload each way (default 14: one V3 token, bf16)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2, help="workers asked per layer (default 2)")
    parser.add_argument("--dim", type=int, default=7168, help="model width (default 7168: DeepSeek-V3)")
    parser.add_argument("--rounds", type=int, default=3, help="layer contenders alternated this many times")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    parser.add_argument("--auth", action="store_true", help="only today's link vs the authenticated candidates")
    args = parser.parse_args()
    if args.auth:
        layer = {
            "workers": args.workers,
            "request_bytes": _layer_request(args.dim).numel(),
            "reply_bytes": args.dim * 8,
        }
        layer.update(_auth_rounds(args.workers, args.dim, args.calls, args.rounds))
        print(json.dumps({"calls": args.calls, "layer": layer}))
        return
    values = max(1, int(args.kib * 1024) // 4)  # float32 elements
    gloo = summary(gloo_round_trips(values, args.calls))
    ray = None if args.no_ray else summary(ray_round_trips(values, args.calls))
    result = {"payload_bytes": values * 4, "calls": args.calls, "gloo": gloo, "ray": ray}
    result["layer"] = {
        "workers": args.workers,
        "request_bytes": _layer_request(args.dim).numel(),
        "reply_bytes": args.dim * 8,
    }
    layer = result["layer"]
    layer.update(_layer_rounds(args.workers, args.dim, args.calls, args.rounds))
    gloo_us = layer["gloo_one_group"]["median_us"]
    layer["socket_vs_gloo"] = round(layer["socket_per_worker"]["median_us"] / gloo_us, 2)
    layer["gloo_per_worker_vs_gloo"] = round(layer["gloo_group_per_worker"]["median_us"] / gloo_us, 2)
    if ray is not None:
        result["ray_vs_gloo_round_trip"] = round(ray["median_us"] / gloo["median_us"], 1)
    else:
        result["ray"] = "left out (--no-ray)" if args.no_ray else "not installed: pip install ray"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
