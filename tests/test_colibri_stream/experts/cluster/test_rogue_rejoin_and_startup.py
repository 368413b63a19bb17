"""Lost workers with a cluster key (issue #70): while a worker is lost, clients without the key (the old
protocol, the new one without a key or with a wrong one) cannot take its rank, and the tokens stay one
process's; a local worker killed while it starts up does not end the run either."""

from __future__ import annotations

import json
import subprocess
import time

from colibri_stream.experts.cluster.coordinator import DistributedExperts
from colibri_stream.experts.cluster.group import ClusterOptions
from colibri_stream.experts.cluster.members import LOST
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
from tests.test_colibri_stream.experts.cluster.test_cluster_key import assert_all_refused, rogue_attempts
from tests.test_colibri_stream.experts.cluster.test_worker_faults import colibri, in_process, workers_of

PROMPT = [5, 9, 2, 7]
TOKENS = 6


def open_runtime(container, kv_dir, workers: int):
    cluster = ClusterOptions(local_workers=workers, timeout_s=30) if workers else None
    options = RuntimeOptions(store=StoreOptions(ram="40%"), kv_dir=kv_dir, text=False, cluster=cluster)
    return load_runtime(container, options)


def test_clients_without_the_key_cannot_take_a_lost_workers_rank(make_container, tmp_path):
    container = make_container("deepseek_v3", "int4")
    alone = open_runtime(container, tmp_path / "alone", 0)
    try:
        expected = run_turn(alone, PROMPT, TurnOptions(max_new_tokens=TOKENS)).ids
    finally:
        alone.close()
    runtime = open_runtime(container, tmp_path / "kv", 2)
    try:
        experts = runtime.loaded.experts
        assert isinstance(experts, DistributedExperts) and experts.local is not None
        experts.local.processes[1].kill()  # lost at the next request
        first = run_turn(runtime, PROMPT, TurnOptions(max_new_tokens=TOKENS)).ids
        assert experts.members[1].state == LOST
        assert_all_refused(rogue_attempts(experts.listener.port))
        time.sleep(0.3)
        again = run_turn(runtime, PROMPT, TurnOptions(max_new_tokens=TOKENS)).ids  # a rogue would join here
        assert experts.members[1].state == LOST and experts.members[1].link is None
        assert experts.members[2].serving
    finally:
        runtime.close()
    assert first == expected and again == expected


def test_a_local_worker_killed_while_it_starts_leaves_one_process_tokens(make_container, tmp_path):
    container = make_container("deepseek_v3", "int4")
    status, out, err = in_process(
        "run", container, "--ids", "3,1,4,1,5", "--max-new-tokens", TOKENS, "--json", "--kv-dir", tmp_path / "a"
    )
    assert status == 0, err
    expected = json.loads(out.splitlines()[-1])["ids"]
    command = colibri(
        "run", container, "--ids", "3,1,4,1,5", "--max-new-tokens", TOKENS, "--json", "--local-workers", 2,
        "--ram", "40%", "--kv-dir", tmp_path / "b",
    )  # fmt: skip
    coordinator = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = workers_of(coordinator, 2)[1]  # still importing torch: long before its HELLO
        victim.kill()
        out, err = coordinator.communicate(timeout=180)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    assert coordinator.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    assert result["ids"] == expected
    lost = [w for w in result["stats"]["workers"] if w["state"] == "lost"]
    assert len(lost) == 1 and lost[0]["pid"] == victim.pid and "exited with status -9" in lost[0]["last_loss"]
    assert "Traceback" not in err and "during start-up" in err
