"""`colibri-stream chat` through stdin scripts: turns, footers, :stats, :reset, warm resume in a new process."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

from colibri_stream import cli

FOOTER = re.compile(
    r"\[(\d+) tok at [\d.]+ tok/s, TTFT [\d.]+s, hits ([\d.]+%|resident|n/a), ([\d.]+) MB/tok read, reused (\d+) tok\]"
)


def chat(path, kv_dir, script: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "colibri_stream",
        "chat",
        str(path),
        "--kv-dir",
        str(kv_dir),
        "--session",
        "talk",
        "--max-new-tokens",
        "6",
        *extra,
    ]
    done = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_two_turns_then_a_restart_resumes_warm(make_container, tmp_path):
    container = make_container("deepseek_v3")
    first = chat(container, tmp_path, "Hello there\nAnd then?\n:stats\n", "--ram", "60%")
    footers = FOOTER.findall(first.stderr)
    assert len(footers) == 2, first.stderr
    assert footers[0][3] == "0" and int(footers[1][3]) > 0  # turn 2 reuses turn 1's prompt
    assert footers[0][1].endswith("%") and float(footers[0][2]) > 0  # streamed experts: hits and MB read
    stats = json.loads(first.stderr.strip().splitlines()[-1])
    assert stats["messages"] == 4 and stats["stored_tokens"] > 0 and stats["store"]["expert_requests"] > 0

    third = chat(container, tmp_path, "One more\n", "--ram", "60%")  # a new process
    assert "resumed, 4 messages" in third.stderr
    (footer,) = FOOTER.findall(third.stderr)
    assert int(footer[3]) > int(footers[1][3])  # the whole history before the new line comes from the log
    transcript = json.loads((tmp_path / "talk.chat.json").read_text())["messages"]
    assert [m["role"] for m in transcript] == ["user", "assistant"] * 3
    assert transcript[4]["content"] == "One more"


def test_reset_forgets_the_conversation(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["kimi_k2"]
    chat(checkpoint, tmp_path, "Hello\n")
    done = chat(checkpoint, tmp_path, ":reset\nHello\n:stats\n")
    assert "conversation reset" in done.stderr
    (footer,) = FOOTER.findall(done.stderr)
    assert footer[1] == "resident" and footer[3] == "0"
    assert json.loads(done.stderr.strip().splitlines()[-1])["messages"] == 2
    assert cli.main(["kv", "rm", str(checkpoint), "talk", "--kv-dir", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("talk.*"))  # the log and the transcript


def test_bad_session_names_are_refused(tiny_checkpoints, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "colibri_stream",
        "chat",
        str(tiny_checkpoints["kimi_k2"]),
        "--kv-dir",
        str(tmp_path),
        "--session",
        "../escape",
    ]
    done = subprocess.run(cmd, input="hi\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "session name" in done.stderr
    assert not list(tmp_path.parent.glob("escape*"))


def test_ctrl_c_stops_the_answer_and_keeps_the_session(tiny_checkpoints, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "colibri_stream",
        "chat",
        str(tiny_checkpoints["deepseek_v3"]),
        "--kv-dir",
        str(tmp_path),
        "--max-new-tokens",
        "400",
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("Tell me everything\n")
        proc.stdin.flush()
        proc.stdout.read(1)  # the answer is streaming
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(":stats\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    (footer,) = FOOTER.findall(err)
    assert int(footer[0]) < 400 and "(stopped)" in err
    stats = json.loads(err.strip().splitlines()[-1])  # the stopped answer is part of the conversation
    # every position that ran is stored: the prompt and all answer tokens but the last (never run)
    assert (
        stats["messages"] == 2 and stats["stored_tokens"] == stats["last_turn"]["prefill_tokens"] + int(footer[0]) - 1
    )
