"""`kiln generate` end to end in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

KILN = [sys.executable, "-m", "kiln.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    """`kiln ARGS` with `--graph-mode eager` after the subcommand: these tests are about the command, not graph
    mode (the default, whose compile of the default model takes minutes cold on 2 cores)."""
    return subprocess.run(
        [*KILN, args[0], "--graph-mode", "eager", *args[1:]], capture_output=True, text=True, timeout=300
    )


def test_generate_json_has_the_fields() -> None:
    argv = ["--prompt", "The capital of France is", "--prompt", "2 + 2 =", "--max-tokens", "6", "--json"]
    proc = run("generate", *argv)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["The capital of France is", "2 + 2 ="]
    for r in records:
        assert set(r) >= {"prompt", "text", "token_ids", "finish_reason", "num_prompt_tokens"}
        assert 1 <= len(r["token_ids"]) <= 6 and r["num_prompt_tokens"] > 0
        assert r["finish_reason"] in ("stop", "length")
    assert "Paris" in records[0]["text"]


def test_missing_model_is_one_line_without_traceback() -> None:
    proc = run("generate", "--model", "/no/such/model.gguf", "--prompt", "hi")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "kiln: error: /no/such/model.gguf: no such file or directory (expected a .gguf file or an HF model directory)"
    )


def test_a_bad_flag_value_or_a_missing_model_is_reported_before_torch_loads() -> None:
    """Checked before the engine is imported (torch and inductor take ~7 s on a 2-core machine): the error is the
    same one line, in a fraction of the time."""
    argvs = [
        ["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"],
        ["generate", "--prompt", "hi", "--temperature", "-2"],
    ]
    code = (
        "import sys, kiln.cli\n"
        f"for argv in {argvs!r}:\n"
        "    assert kiln.cli.main(argv) == 1\n"
        "print(sorted(m for m in ('torch', 'kiln.engine.serving.llm') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert "no such file or directory" in proc.stderr and "temperature=-2.0: must be in [0, 2]" in proc.stderr


def test_too_long_prompt_is_a_clear_error() -> None:
    proc = run("generate", "--prompt", "hello " * 100, "--max-model-len", "32", "--max-tokens", "4")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "exceeds max_model_len=32" in proc.stderr


def test_bad_sampling_flag_is_a_clear_error() -> None:
    proc = run("generate", "--prompt", "hi", "--temperature", "-2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "temperature=-2.0: must be in [0, 2]" in proc.stderr


def test_chat_streams_replies_and_keeps_history() -> None:
    proc = subprocess.run(
        [*KILN, "chat", "--graph-mode", "eager", "--max-tokens", "8"],
        input="What is the capital of France?\n/reset\nSay hi.\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    replies = [line for line in proc.stdout.split("> ") if line.strip()]
    assert len(replies) == 2 and "Paris" in replies[0]
