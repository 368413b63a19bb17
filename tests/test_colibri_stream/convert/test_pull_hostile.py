"""`pull` against a Hub that does not keep to its own listing (colibri_stream/devtools/fake_hub.py's
hostile modes): Range ignored, a body longer than listed or endless, an endless config.json without a
listed size, a drip-fed body, a partial download longer than listed, bad repo ids and revisions. Each
ends in one line (exit 1) with the disk (and, in a child process, the peak RSS) within the listing's
sizes plus a small constant, and the same command against an honest Hub then finishes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from colibri_stream import cli
from colibri_stream.convert.pull import Pull, PullOptions
from colibri_stream.convert.pull_http import Deadlines, PullError
from colibri_stream.convert.pull_hub import SIDE_FILE_CAP
from colibri_stream.convert.pull_space import complete_container, tree_bytes
from colibri_stream.devtools.fake_hub import FakeHub, FakeRepo, Faults, HubEnv
from colibri_stream.devtools.hub_fixture import build_sharded_fp8_checkpoint

REPO = "org/tiny-model"
SHARD = "model-00005-of-00015.safetensors"
SLACK = 256 << 10  # the download directory's bookkeeping beyond the listed files (partial files' blocks)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> FakeRepo:
    return FakeRepo.from_dir(build_sharded_fp8_checkpoint(tmp_path_factory.mktemp("hub-fixture")))


def _pull(out: Path, **options) -> dict:
    return Pull(PullOptions(REPO, out, progress=False, **options), lambda event: None).run()


def _listed_bound(repo: FakeRepo, in_flight: int = 2) -> int:
    """What the download directory may hold by the listing: the small files and the largest shards."""
    shards = sorted((len(d) for n, d in repo.files.items() if n.endswith(".safetensors")), reverse=True)
    small = sum(len(d) for n, d in repo.files.items() if not n.endswith(".safetensors"))
    return small + sum(shards[:in_flight]) + SLACK


@contextmanager
def _peak_disk(*dirs: Path) -> Iterator[list[int]]:
    """The most the directories held together, polled every 2 ms while the block runs."""
    peak, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sum(tree_bytes(d) for d in dirs))
            time.sleep(0.002)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        stop.set()
        watcher.join()


def _honest_rerun(repo: FakeRepo, hub: FakeHub, out: Path) -> None:
    hub.faults = Faults()
    assert _pull(out)["status"] == "pulled"
    assert complete_container(out)


def test_a_body_longer_than_listed_stops_at_the_listed_size_and_the_part_is_deleted(repo, tmp_path):
    out, downloads = tmp_path / "out.cstream", tmp_path / "out.cstream.download"
    faults = Faults(oversize={SHARD: 64 << 20})  # 64 MiB sent for a ~48 KB shard
    with FakeHub({REPO: repo}, faults) as hub, HubEnv(hub, tmp_path), _peak_disk(downloads) as peak:
        with pytest.raises(PullError) as stopped:
            _pull(out)
        assert not (downloads / (SHARD + ".part")).exists()
        _honest_rerun(repo, hub, out)
    line = str(stopped.value)
    assert "\n" not in line and SHARD in line and f"more than the {len(repo.files[SHARD])} bytes it lists" in line
    assert peak[0] <= _listed_bound(repo), (peak[0], _listed_bound(repo))
    sent = sum(e.body_bytes for e in hub.log if e.path.endswith(SHARD) and e.range is None)
    assert sent < 64 << 20  # the client hung up; it did not take the body whole


def test_a_partial_file_longer_than_listed_is_deleted_not_continued(repo, tmp_path):
    """What an oversized body left behind before this fix: the same command against an honest Hub
    starts that shard over instead of asking for bytes past its end on every run."""
    out, downloads = tmp_path / "out.cstream", tmp_path / "out.cstream.download"
    downloads.mkdir()
    (downloads / (SHARD + ".part")).write_bytes(b"\0" * (len(repo.files[SHARD]) + 100_000))
    with FakeHub({REPO: repo}) as hub, HubEnv(hub, tmp_path):
        assert _pull(out)["status"] == "pulled"
    gets = [e for e in hub.log if e.path.endswith(SHARD) and e.method == "GET" and e.range is None]
    assert len(gets) == 1 and gets[0].status == 200  # from byte 0, not a Range past the end


def test_a_partial_file_failing_its_hash_is_fetched_again(repo, tmp_path):
    out, downloads = tmp_path / "out.cstream", tmp_path / "out.cstream.download"
    downloads.mkdir()
    (downloads / (SHARD + ".part")).write_bytes(b"\xff" * 1000)  # not the shard's first 1000 bytes
    with FakeHub({REPO: repo}) as hub, HubEnv(hub, tmp_path):
        assert _pull(out)["status"] == "pulled"
    gets = [
        e
        for e in hub.log
        if e.path.endswith(SHARD) and e.method == "GET" and not (e.range or "").startswith("bytes=0-")
    ]
    assert [e.range for e in gets] == ["bytes=1000-", None]  # continued, failed its sha256, fetched whole


def test_a_hub_that_ignores_range_is_skipped_through_while_streaming(repo, tmp_path):
    """A connection dropped mid-shard, then every Range answered 200 with the whole body: the bytes
    already held are skipped as they stream by, never buffered, and the shard is right."""
    out, downloads = tmp_path / "out.cstream", tmp_path / "out.cstream.download"
    faults = Faults(ignore_range=True, drop_after={SHARD: (20000, 1)})
    with FakeHub({REPO: repo}, faults) as hub, HubEnv(hub, tmp_path), _peak_disk(downloads) as peak:
        assert _pull(out)["status"] == "pulled"
    gets = [e for e in hub.log if e.path.endswith(SHARD) and e.method == "GET"]
    assert [(e.range, e.status) for e in gets[-2:]] == [(None, 200), ("bytes=20000-", 200)]
    assert peak[0] <= _listed_bound(repo)


def test_an_endless_config_json_without_a_listed_size_stops_at_the_cap(repo, tmp_path):
    out, downloads = tmp_path / "out.cstream", tmp_path / "out.cstream.download"
    faults = Faults(oversize={"config.json": None}, listed={"config.json": None})
    with FakeHub({REPO: repo}, faults) as hub, HubEnv(hub, tmp_path), _peak_disk(downloads) as peak:
        with pytest.raises(
            PullError, match=f"config.json: the Hub lists no size for it and sent more than {SIDE_FILE_CAP}"
        ):
            _pull(out)
        assert not list(downloads.glob("config.json*"))
        _honest_rerun(repo, hub, out)
    assert peak[0] <= SIDE_FILE_CAP + _listed_bound(repo)


def test_an_endless_config_json_with_a_listed_size_stops_at_that_size(repo, tmp_path):
    faults = Faults(oversize={"config.json": None})
    with FakeHub({REPO: repo}, faults) as hub, HubEnv(hub, tmp_path):
        with pytest.raises(PullError, match=f"more than the {len(repo.files['config.json'])} bytes it lists"):
            _pull(tmp_path / "out.cstream")


def test_a_stalled_body_ends_at_the_stall_deadline_and_the_next_run_continues(repo, tmp_path):
    out = tmp_path / "out.cstream"
    with FakeHub({REPO: repo}, Faults(drip={SHARD: 2.0})) as hub, HubEnv(hub, tmp_path):
        with pytest.raises(PullError, match=r"no byte from .* for 0.3 s \(--stall-timeout\)"):
            _pull(out, deadlines=Deadlines(stall_s=0.3))
        assert (out.with_name("out.cstream.download") / (SHARD + ".part")).stat().st_size >= 1
        _honest_rerun(repo, hub, out)


def test_a_drip_fed_body_ends_at_the_overall_deadline(repo, tmp_path):
    """One byte every 50 ms never trips a 1 s stall deadline; at --min-rate 1 MB/s, after the 1 s of
    grace the bytes must keep up with 1 MB/s (a 48 KB shard: 1.05 s in all)."""
    with FakeHub({REPO: repo}, Faults(drip={SHARD: 0.05})) as hub, HubEnv(hub, tmp_path):
        with pytest.raises(PullError, match=r"below --min-rate 1e\+06 bytes/s"):
            _pull(tmp_path / "out.cstream", deadlines=Deadlines(stall_s=1.0, min_rate=1e6))


@pytest.mark.parametrize(
    "argv",
    [
        ["../../x/y"],
        ["org/name/extra"],
        ["org/.."],
        ["org/na--me"],
        ["org/-name"],
        ["org/" + "n" * 97],
        ["org/name", "--revision", "../main"],
        ["org/name", "--revision", "main\n"],
        ["org/name", "--revision", "a b"],
    ],
)
def test_bad_repo_ids_and_revisions_are_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing is asked of any Hub
    assert cli.main(["pull", *argv, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("colibri-stream pull: error: ") and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_redirect_loops_and_non_http_redirects_are_one_line(repo, tmp_path):
    for location in ("/org/tiny-model/resolve/main/config.json", "ftp://127.0.0.1/config.json"):
        with FakeHub({REPO: repo}, Faults(redirect={"config.json": location})) as hub, HubEnv(hub, tmp_path):
            with pytest.raises(PullError, match="redirects|not http"):
                _pull(tmp_path / "out.cstream", plan_only=True)


def _cli_max_rss(out: Path, env_hub: FakeHub, root: Path, *flags: str) -> tuple[int, str, int]:
    """(exit status, stderr, peak RSS in bytes) of the CLI in a child of a small wrapper process, whose
    RUSAGE_CHILDREN is that child's alone."""
    wrapper = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stderr.write(p.stderr); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "sys.exit(p.returncode)"
    )
    argv = [sys.executable, "-m", "colibri_stream", "pull", REPO, "--out", str(out), "--no-progress", *flags]
    with HubEnv(env_hub, root):
        done = subprocess.run([sys.executable, "-c", wrapper, *argv], capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr, int(done.stdout.strip().splitlines()[-1]) * 1024


def test_hostile_hub_in_a_child_process_peak_rss_and_disk_within_the_listing(repo, tmp_path):
    """The CLI against a Hub that ignores Range and sends a shard as an endless body (the header probe
    and the download both meet it): exit 1, one line, peak RSS within 64 MiB of the honest rerun's, the
    download directory within the listing; then the same command against the honest Hub exits 0."""
    out, downloads = tmp_path / "out.cstream", tmp_path / "out.cstream.download"
    with FakeHub({REPO: repo}, Faults(ignore_range=True, oversize={SHARD: None})) as hub:
        with _peak_disk(downloads) as peak:
            code, err, hostile_rss = _cli_max_rss(out, hub, tmp_path)
        hub.faults = Faults()
        honest_code, honest_err, honest_rss = _cli_max_rss(out, hub, tmp_path)
    assert code == 1 and err.count("\n") == 1 and "error: " in err and SHARD in err, err
    assert honest_code == 0, honest_err
    assert hostile_rss <= honest_rss + (64 << 20), (hostile_rss, honest_rss)
    assert peak[0] <= _listed_bound(repo), (peak[0], _listed_bound(repo))
    assert complete_container(out)
    assert json.loads((out / "zarr.json").read_text())
