from colibri_stream.cli import main

raise SystemExit(main())
