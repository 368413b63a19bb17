"""`serve` as the coordinator: two clients at once over 2 local workers get the completions one process
gives them, while the dashboard (another thread) asks the workers for their counters; the stats add up."""

from __future__ import annotations

import threading

from colibri_stream.experts.cluster.group import ClusterOptions
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.app import Server
from tests.test_colibri_stream.serve.test_dashboard import MODEL, complete, serving, stats

PROMPTS = ("The quick brown fox", "Several machines as one")


def cluster_runtime(container, kv_dir, workers: int, timeout_s: float = 120):
    cluster = ClusterOptions(local_workers=workers, timeout_s=timeout_s)
    options = RuntimeOptions(kv_dir=kv_dir, model_id=MODEL, store=StoreOptions(ram="40%"), cluster=cluster)
    return load_runtime(container, options)


def served_completions(container, kv_dir, workers: int) -> tuple[list[str], dict]:
    runtime = cluster_runtime(container, kv_dir, workers)
    try:
        with serving(Server(runtime, slots=2, max_queue=2)) as port:
            texts: dict[int, str] = {}
            dashboard: list[dict] = []

            def client(i: int) -> None:
                texts[i] = complete(port, PROMPTS[i], max_tokens=10)["choices"][0]["text"]

            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads):  # the dashboard polls while both generate
                dashboard.append(stats(port))
            for thread in threads:
                thread.join()
            dashboard.append(stats(port))
            return [texts[i] for i in range(len(PROMPTS))], dashboard[-1]
    finally:
        runtime.close()


def test_two_clients_over_workers_get_one_process_completions(make_container, tmp_path):
    container = make_container("deepseek_v3", "int4")
    expected, _ = served_completions(container, tmp_path / "alone", 0)
    got, last = served_completions(container, tmp_path / "workers", 2)
    assert got == expected
    routed = sum(map(sum, last["heat"]))
    assert routed == last["experts"]["requests"] > 0  # every routed expert was requested from a worker
    assert last["tiers"][0]["slots"] > 0
