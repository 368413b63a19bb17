"""The Hub-responses fuzz surface (``hub``): `pull` against a Hub on 127.0.0.1 (devtools/fake_hub.py) that
answers the tiny sharded FP8 checkpoint's files with drawn faults: sizes (bodies longer than listed or
endless, listed sizes missing, zero, negative, huge, off by one, of the wrong JSON type), Range (ignored,
answered with a status), redirects (loops, to another host, to ftp, scheme-relative, garbage), drip-fed
bodies (seconds per byte against a drawn --stall-timeout and --min-rate), dropped connections and
corrupted bodies.

A case runs ``pull`` once against the faulty Hub, then the same command against the honest one. BAD: a
traceback, an exit without its one line (the usual judgements), a download directory that held more
than the listing allows (``over-listing``: the small files at their listed size or the 64 MiB cap, the
two largest listed shards, and a little bookkeeping), or a rerun against the honest Hub that does not
finish (``no-recovery``). The fixture is built once per fuzz child (~13 s) and held in memory.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from colibri_stream.devtools.fuzz.harness import BAD_LISTING, BAD_STUCK
from colibri_stream.devtools.fuzz.scenarios import (
    Scenario,
    _bad,
    _finish,
    _must_not_break,
    _refused_after_checks,
    _step,
)

REPO = "org/tiny-model"
PULL = ["pull", REPO, "--out", "out.cstream", "--json", "--no-progress"]
SLACK = 256 << 10  # the download directory's bookkeeping beyond the listed files
# pull's own bounds (convert/pull_hub.py: SIDE_FILE_CAP, MAX_FILE_BYTES; devtools does not import the
# applications, and tests/test_colibri_stream/devtools/test_fuzz_hub_surface.py checks they agree)
SIDE_FILE_CAP = 64 << 20
MAX_FILE_BYTES = 1 << 50
LISTED = (None, 0, 1, -1, "minus-one", "plus-one", 2**60, "12", True, 1.5)
REDIRECTS = ("loop", "other-host", "ftp", "scheme-relative", "garbage", "long")
STATUSES = (204, 301, 401, 404, 416, 429, 500, 503)

_REPO: Any = None  # the FakeRepo, built once per fuzz child


def _repo() -> Any:
    global _REPO
    if _REPO is None:
        from colibri_stream.devtools.fake_hub import FakeRepo
        from colibri_stream.devtools.hub_fixture import build_sharded_fp8_checkpoint

        with tempfile.TemporaryDirectory(prefix="fuzz-hub-") as tmp:
            _REPO = FakeRepo.from_dir(build_sharded_fp8_checkpoint(Path(tmp)))
    return _REPO


def _fault() -> st.SearchStrategy[dict[str, Any]]:
    file = st.integers(0, 10**6)
    one = st.one_of(
        st.fixed_dictionaries(
            {"fault": st.just("oversize"), "file": file, "extra": st.sampled_from([1, 4096, 1 << 20, None])}
        ),
        st.fixed_dictionaries({"fault": st.just("listed"), "file": file, "value": st.sampled_from(LISTED)}),
        st.fixed_dictionaries(
            {"fault": st.just("drip"), "file": file, "seconds": st.sampled_from([0.001, 0.02, 0.3, 1.5])}
        ),
        st.fixed_dictionaries({"fault": st.just("redirect"), "file": file, "to": st.sampled_from(REDIRECTS)}),
        st.fixed_dictionaries({"fault": st.just("status"), "file": file, "code": st.sampled_from(STATUSES)}),
        st.fixed_dictionaries(
            {"fault": st.just("drop"), "file": file, "after": st.integers(0, 60_000), "times": st.integers(1, 3)}
        ),
        st.fixed_dictionaries({"fault": st.just("corrupt"), "file": file, "times": st.integers(1, 4)}),
    )
    return one


def _params() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "faults": st.lists(_fault(), min_size=1, max_size=3),
            "ignore_range": st.booleans(),
            "stall_s": st.sampled_from([0.3, 1.0]),
            "min_rate": st.sampled_from(["200k", "2M"]),
        }
    )


def _faults(params: dict[str, Any], repo: Any, url: str) -> Any:
    """The drawn faults on the repo's files (a file index picks among them, in name order)."""
    from colibri_stream.devtools.fake_hub import Faults

    names = sorted(repo.files)
    faults = Faults(ignore_range=params["ignore_range"])
    for fault in params["faults"]:
        name = names[fault["file"] % len(names)]
        size = len(repo.files[name])
        kind = fault["fault"]
        if kind == "oversize":
            faults.oversize[name] = None if fault["extra"] is None else size + fault["extra"]
        elif kind == "listed":
            value = fault["value"]
            faults.listed[name] = {"minus-one": size - 1, "plus-one": size + 1}.get(value, value)
        elif kind == "drip":
            faults.drip[name] = fault["seconds"]
        elif kind == "redirect":
            faults.redirect[name] = _location(fault["to"], url, name)
        elif kind == "status":
            faults.status[name] = fault["code"]
        elif kind == "drop":
            faults.drop_after[name] = (fault["after"], fault["times"])
        else:
            faults.corrupt[name] = fault["times"]
    return faults


def _location(kind: str, url: str, name: str) -> str:
    path = f"/{REPO}/resolve/main/{name}"
    return {
        "loop": path,
        "other-host": url.replace("127.0.0.1", "localhost") + path,  # the same Hub: the token is dropped
        "ftp": "ftp://127.0.0.1" + path,
        "scheme-relative": "//127.0.0.1:9" + path,  # a port nothing listens on
        "garbage": "http://[::1" + path,
        "long": url + path + "?" + "x" * 100_000,
    }[kind]


def _listed_bound(repo: Any, faults: Any) -> int:
    """What the download directory may hold by the listing the faulty Hub gives."""
    side, shards = 0, []
    for name, data in repo.files.items():
        value = faults.listed.get(name, len(data))
        valid = type(value) is int and 0 <= value <= MAX_FILE_BYTES
        if name.endswith(".safetensors"):
            shards.append(value if valid else 0)
        else:
            side += min(value, SIDE_FILE_CAP) if valid else SIDE_FILE_CAP
    return side + sum(sorted(shards, reverse=True)[:2]) + SLACK


def _tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (0 while it does not exist; files may vanish as it is read)."""
    total = 0
    for directory, _, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


def hub_responses(case_dir: str, params_json: str, canary: str) -> int:
    """`pull` against the faulty Hub, then the same command against the honest one."""
    from colibri_stream.devtools.fake_hub import FakeHub, Faults, HubEnv

    params = json.loads(params_json)
    repo = _repo()

    def run() -> None:
        os.chdir(case_dir)
        downloads = Path(case_dir) / "out.cstream.download"
        flags = ["--stall-timeout", str(params["stall_s"]), "--min-rate", params["min_rate"]]
        with FakeHub({REPO: repo}) as hub, HubEnv(hub, Path(case_dir)):
            hub.faults = faults = _faults(params, repo, hub.url)
            peak, stop = [0], threading.Event()

            def poll() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], _tree_bytes(downloads))
                    time.sleep(0.005)

            watcher = threading.Thread(target=poll, daemon=True)
            watcher.start()
            try:
                first = _must_not_break(_step([*PULL, *flags]))
            finally:
                stop.set()
                watcher.join()
            bound = _listed_bound(repo, faults)
            if peak[0] > bound:
                raise _bad(BAD_LISTING, f"the download directory held {peak[0]} bytes; the listing allows {bound}")
            hub.faults = Faults()
            again = _must_not_break(_step(list(PULL)))
            if again.code != 0:
                raise _bad(BAD_STUCK, f"the rerun against the honest Hub: {again.error_lines[:1] or again.err[-200:]}")
        _refused_after_checks(first)

    return _finish(run)


HUB_SCENARIOS: dict[str, Scenario] = {
    "hub": Scenario("hub", (), "hub_responses", _params, module=__name__),
}
