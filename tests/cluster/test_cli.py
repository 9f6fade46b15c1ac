"""The `specserve` console script: one argparse parser for every subcommand, render-k8s and in-process generate."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from cluster.cli import build_parser, main


def test_parser_knows_every_command():
    parser = build_parser()
    args = parser.parse_args(["serve", "configs/local.yaml", "--port", "9000"])
    assert (args.command, args.config, args.host, args.port) == ("serve", "configs/local.yaml", None, 9000)
    args = parser.parse_args(["generate", "c.yaml", "--prompt", "hi", "--chat", "--max-tokens", "5", "--arm", "asd",
                              "--no-speculation", "--json"])
    assert args.chat and args.no_speculation and args.json and args.max_tokens == 5 and args.arm == "asd"
    assert parser.parse_args(["status"]).command == "status"
    args = parser.parse_args(["render-k8s", "c.yaml", "--image", "img:1", "--out", "x.yaml"])
    assert (args.image, args.out) == ("img:1", "x.yaml")


def test_instruments_parse_through_the_same_parser():
    """bench, eval and ab report are argparse subcommands: the global -v goes before them, their flags after."""
    from bench.run import run_command
    from experiments import ab_report
    from experiments.eval import cli as eval_cli

    parser = build_parser()
    args = parser.parse_args(["-v", "bench", "--section", "vllm", "--quick", "--out", "o", "--skip", "hf", "c.yaml"])
    assert args.verbose and (args.command, args.section, args.quick, args.out, args.skip) == ("bench", "vllm", True,
                                                                                          "o", "hf")
    assert args.config == "c.yaml" and args.handler is run_command
    assert parser.parse_args(["bench"]).config == "configs/local.yaml"
    args = parser.parse_args(["eval", "c.yaml", "--arms", "exact,asd", "--limit", "3"])
    assert (args.config, args.arms, args.limit, args.handler) == ("c.yaml", "exact,asd", 3, eval_cli.run)
    args = parser.parse_args(["-v", "ab", "report", "--file", "e.json", "--json", "--resamples", "50"])
    assert args.verbose and (args.ab_command, args.file.name, args.json, args.resamples) == ("report", "e.json",
                                                                                           True, 50)
    assert args.handler is ab_report.run


@pytest.mark.parametrize("argv, usage", [(["ab", "report", "--help"], "specserve ab report"),
                                         (["-v", "bench", "--help"], "specserve bench"),
                                         (["bench", "--section", "vllm", "--help"], "specserve bench"),
                                         (["eval", "--help"], "specserve eval")])
def test_instrument_help_is_their_own(argv, usage, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0 and usage in capsys.readouterr().out


def test_ab_alone_lists_its_subcommands(capsys):
    assert main(["ab"]) == 0
    assert "report" in capsys.readouterr().out


def test_bad_instrument_arguments_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--section", "nope"])
    assert info.value.code == 2 and "--section" in capsys.readouterr().err
    assert main(["-v", "eval"]) == 2  # neither CONFIG nor --url: eval's own message
    assert "CONFIG" in capsys.readouterr().err


def test_missing_config_is_an_error_not_a_traceback(capsys):
    assert main(["generate", "does-not-exist.yaml", "--prompt", "hi"]) == 2
    assert "does-not-exist.yaml" in capsys.readouterr().err


def test_render_k8s_writes_a_rayservice(tmp_path, capsys):
    out = tmp_path / "rs.yaml"
    assert main(["render-k8s", "configs/local.yaml", "--image", "specserve:test", "--out", str(out)]) == 0
    manifest = yaml.safe_load(out.read_text())
    assert manifest["kind"] == "RayService"
    assert "specserve:test" in out.read_text()
    printed = capsys.readouterr().out
    assert str(out) in printed
    from cluster.k8s.crd import find_crd_dir

    if find_crd_dir() is not None:  # the CRDs beside the repository (../shared/kuberay): validated strictly
        assert "valid against the KubeRay CRD" in printed


def tiny_local_config(model_dir, tmp_path) -> str:
    config = {
        "name": "tiny-cli",
        "target": {"source": str(model_dir), "served_name": "tiny", "max_seq_len": 256, "max_batch_size": 2},
        "drafter": {"kind": "ngram"},
        "arms": [{"name": "exact"}, {"name": "asd", "verification": "asd",
                                     "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}}],
        "serving": {"max_tokens_limit": 64, "default_max_tokens": 8},
        "unit": {"torch_threads": 1},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("extra", [[], ["--arm", "asd", "--chat"], ["--no-speculation"]])
def test_generate_json_prints_one_line(tiny_llama_dir, tmp_path, capsys, extra):
    config = tiny_local_config(tiny_llama_dir, tmp_path)
    assert main(["generate", config, "--prompt", "a b c a b c", "--max-tokens", "6", "--json", *extra]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert set(result) == {"text", "token_ids", "usage"}
    usage = result["usage"]
    assert usage["completion_tokens"] == len(result["token_ids"]) <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    spec = usage["speculative"]
    assert spec["arm"] == ("asd" if "asd" in extra else "exact")
    if "--no-speculation" in extra:
        assert spec["draft_tokens"] == 0 and spec["gamma_max"] == 0


def test_generate_no_speculation_matches_speculation_greedy(tiny_llama_dir, tmp_path, capsys):
    config = tiny_local_config(tiny_llama_dir, tmp_path)
    outputs = []
    for extra in ([], ["--no-speculation"]):
        main(["generate", config, "--prompt", "x y x y x y", "--max-tokens", "8", "--json", *extra])
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1]  # exact greedy speculation reproduces the target's greedy output


def _descendants(pid: int) -> list[tuple[str, int | None]]:
    """(command line, niceness) of every process below `pid`, from `ps`."""
    import subprocess

    rows = [line.split(None, 3) for line in subprocess.run(["ps", "-eo", "pid=,ppid=,ni=,args="], check=True,
                                                           capture_output=True, text=True).stdout.splitlines()]
    children: dict[int, list] = {}
    for child, parent, nice, *command in rows:
        nice = int(nice) if nice.lstrip("-").isdigit() else None  # "-": a real-time process
        children.setdefault(int(parent), []).append((int(child), " ".join(command), nice))
    out, frontier = [], [pid]
    while frontier:
        found = [c for p in frontier for c in children.get(p, [])]
        out += [(command, nice) for _, command, nice in found]
        frontier = [c for c, _, _ in found]
    return out


@pytest.mark.slow
def test_serve_starts_answers_and_stops_on_sigterm(tiny_llama_dir, tmp_path):
    """`specserve serve` starts its own local Ray (token auth on, as Ray 2.60 defaults) with its workers at
    niceness 0, prints the URL, answers, and on SIGTERM shuts Serve and Ray down and exits 0."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tiny_local_config(tiny_llama_dir, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", config, "--port", str(port),
                             "--address", "local"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline = time.time() + 240
        line = ""
        while time.time() < deadline and "serving at" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "specserve serve exited early"
        assert f"http://127.0.0.1:{port}/v1" in line
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
        niceness = [nice for command, nice in _descendants(proc.pid) if "ServeReplica" in command]
        assert niceness and set(niceness) == {0}  # Ray's workers at the normal priority
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
