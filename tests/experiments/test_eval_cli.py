"""`specserve eval` end to end: an in-process unit (tiny random model), a plug-in suite, resume, bad input; the
HTTP backend with the real `openai` client against a small local OpenAI-shaped server."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import yaml

from experiments.eval.backends import BackendUnavailable, CompletionRequest, HTTPBackend
from experiments.eval.cli import main
from experiments.eval.suites import EvalPrompt, load_suite

PLUGIN = '''
from experiments.eval.suites import EvalPrompt, Problem, Score


class Repeat:
    """Continue a repetitive text; passes when the answer is non-empty (a random model answers anything)."""

    name = "repeat"
    binary = True

    def problems(self):
        texts = ["a b c a b c a b", "x y x y x y x", "one two one two one", "red green red green"]
        return [Problem(f"repeat/{i}", {"text": t}) for i, t in enumerate(texts)]

    def prompt(self, problem):
        return EvalPrompt(prompt=problem.data["text"], max_tokens=6)

    def score(self, problem, completion):
        return Score.of_pass(bool(completion.strip()))


SUITE = Repeat()
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "eval_plugin_suite.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "eval_plugin_suite:SUITE"


@pytest.fixture
def tiny_config(tiny_llama_dir, tmp_path) -> str:
    config = {
        "name": "tiny-eval",
        "target": {"source": str(tiny_llama_dir), "served_name": "tiny", "max_seq_len": 256, "max_batch_size": 2},
        "drafter": {"kind": "ngram"},
        "arms": [{"name": "exact"}, {"name": "asd", "verification": "asd",
                                     "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}}],
        "serving": {"max_tokens_limit": 64, "default_max_tokens": 8},
        "unit": {"torch_threads": 1},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_in_process_eval_writes_results_and_resumes(tiny_config, plugin, tmp_path, capsys):
    out = tmp_path / "out"
    args = [tiny_config, "--suite", plugin, "--arms", "exact,asd", "--limit", "3", "--out", str(out),
            "--resamples", "300"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "[6/6]" in captured.err and "| asd |" in captured.out
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["arm"] for r in rows} == {"exact", "asd"}
    assert all(r["speculative"]["arm"] == r["arm"] and r["output_tokens"] <= 6 for r in rows)
    results = json.loads((out / "results.json").read_text())
    assert results["arms"]["asd"]["verification"] == "asd" and results["paired"]["asd"]["n_pairs"] == 3
    assert results["arms"]["asd"]["settings"]["asd"]["budget"] == 8.0
    assert (out / "frontier.png").is_file() and (out / "report.md").is_file()

    assert main([*args[:-2], "--limit", "4", "--resamples", "300"]) == 0  # one more problem: 2 rows more
    err = capsys.readouterr().err
    assert "resuming, 6 of 8 rows done" in err and "2 answers now, 6 from earlier runs" in err
    assert main(["--out", str(out), "--report-only", "--resamples", "300"]) == 0
    assert json.loads((out / "results.json").read_text())["problems"] == 4


def test_bad_input_gets_a_message_and_a_non_zero_exit(tiny_config, tmp_path, capsys):
    assert main([tiny_config, "--suite", "no-such-suite", "--out", str(tmp_path / "a")]) == 2
    assert "unknown 'no-such-suite'" in capsys.readouterr().err
    assert main([tiny_config, "--suite", "nomodule_xyz:SUITE", "--out", str(tmp_path / "a")]) == 2
    assert "cannot import module" in capsys.readouterr().err
    assert main([tiny_config, "--arms", "exact,bogus", "--limit", "1", "--out", str(tmp_path / "b")]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["--suite", "humaneval", "--out", str(tmp_path / "c")]) == 2  # neither CONFIG nor --url
    assert "CONFIG" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "empty"), "--report-only"]) == 2
    assert "no results" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_url_is_a_clear_error(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    assert main(["--url", url, "--arms", "exact,asd", "--out", str(tmp_path)]) == 2
    assert f"cannot reach a service at {url}/v1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="url"):
        HTTPBackend("127.0.0.1:8000")


class FakeSpecServe(BaseHTTPRequestHandler):
    """/v1/models and the two completion routes, with the arm header and usage.speculative; records requests."""

    arms = ("exact", "asd")
    requests: ClassVar[list[dict]] = []
    echo_arm = True

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: dict, headers: dict | None = None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0,
                                                         "owned_by": "specserve"}]})
        else:
            self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        arm = self.headers.get("x-specserve-arm")
        type(self).requests.append({"path": self.path, "arm": arm, **body})
        if arm not in self.arms:
            self._send(400, {"error": {"message": f"unknown arm {arm!r} in header x-specserve-arm; known arms: "
                                                  f"{list(self.arms)}", "type": "invalid_request_error",
                                       "param": "x-specserve-arm", "code": "unknown_arm"}})
            return
        chat = self.path.endswith("/chat/completions")
        choice = ({"index": 0, "message": {"role": "assistant", "content": "def f():\n    return 1"},
                   "finish_reason": "stop"} if chat else {"index": 0, "text": " 42", "finish_reason": "length"})
        speculative = {"arm": arm, "rounds": 2, "draft_tokens": 4, "accepted_tokens": 3, "acceptance_rate": 0.75}
        self._send(200, {"id": "x", "object": "chat.completion" if chat else "text_completion", "created": 0,
                         "model": body["model"], "choices": [choice],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                   "speculative": speculative}},
                   {"x-specserve-arm": arm if type(self).echo_arm else "exact"})


@pytest.fixture
def fake_service():
    FakeSpecServe.requests = []
    FakeSpecServe.echo_arm = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSpecServe)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_backend_forces_the_arm_and_reads_usage_speculative(fake_service):
    backend = HTTPBackend(fake_service)
    assert backend.model == "tiny"
    backend.check_arms(["exact", "asd"])
    plain = backend.complete(CompletionRequest(EvalPrompt(prompt="x =", max_tokens=5, stop=("\ndef",)), "asd"))
    chat = backend.complete(CompletionRequest(EvalPrompt(messages=({"role": "user", "content": "hi"},)), "exact"))
    assert (plain.text, plain.output_tokens, plain.served_arm, plain.finish_reason) == (" 42", 5, "asd", "length")
    assert plain.speculative["acceptance_rate"] == 0.75 and plain.seconds > 0
    assert chat.text.startswith("def f()") and chat.speculative["arm"] == "exact"
    sent = FakeSpecServe.requests[-2]
    assert (sent["path"], sent["arm"], sent["temperature"], sent["stop"], sent["max_tokens"]) == \
        ("/v1/completions", "asd", 0.0, ["\ndef"], 5)
    with pytest.raises(ValueError, match="unknown arm 'bogus'"):
        backend.check_arms(["bogus"])
    FakeSpecServe.echo_arm = False  # something on the way dropped the request header
    with pytest.raises(ValueError, match="stripped"):
        backend.complete(CompletionRequest(EvalPrompt(prompt="x"), "asd"))
    backend.close()


def test_eval_over_http_runs_a_suite(fake_service, plugin, tmp_path, capsys):
    out = tmp_path / "http"
    assert main(["--url", fake_service, "--suite", plugin, "--arms", "exact,asd", "--out", str(out),
                 "--resamples", "200"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["arms"]["asd"]["n"] == 4 and results["arms"]["asd"]["acceptance_rate"] == 0.75
    assert results["paired"]["asd"]["mcnemar"] == {"b": 0, "c": 0, "p_value": 1.0}


def test_unreachable_backend_error_type():
    with pytest.raises(BackendUnavailable):
        HTTPBackend(f"http://127.0.0.1:{_free_port()}")


def test_specserve_eval_parses_into_run():
    from cluster.cli import build_parser
    from experiments.eval.cli import run

    args = build_parser().parse_args(["eval", "c.yaml", "--suite", "humaneval-rewrite", "--arms", "exact,asd",
                                      "--limit", "5"])
    assert (args.command, args.config, args.suite, args.arms, args.limit) == ("eval", "c.yaml", "humaneval-rewrite",
                                                                              "exact,asd", 5)
    assert args.handler is run
    assert load_suite("humaneval-rewrite").name == "humaneval-rewrite"


def test_closing_after_an_interrupted_request_cancels_it_at_once():
    import asyncio
    import time

    from experiments.eval.backends import InProcessBackend, _ProjectUnit

    state = {"cancelled": False, "closed": False}

    async def generate(prompt, arm):
        asyncio.get_running_loop().call_later(0.05, _interrupt)
        try:
            await asyncio.sleep(60)  # a long generation
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    def _interrupt():
        raise KeyboardInterrupt  # what Ctrl-C does inside run_until_complete

    async def close():
        state["closed"] = True

    backend = InProcessBackend(None, unit_factory=lambda _: _ProjectUnit({"exact": {}}, generate, close))
    with pytest.raises(KeyboardInterrupt):
        backend.complete(CompletionRequest(EvalPrompt(prompt="x"), "exact"))
    start = time.perf_counter()
    backend.close()
    assert time.perf_counter() - start < 5 and state == {"cancelled": True, "closed": True}


def test_eval_protocol_over_http_chooses_on_selection_and_judges_on_held_out(fake_service, plugin, tmp_path, capsys):
    out = tmp_path / "protocol"
    assert main(["--url", fake_service, "--suite", "arith", "--limit", "8", "--arms", "exact,asd", "--protocol",
                 "--split-seed", "3", "--out", str(out), "--resamples", "200"]) == 0
    result = json.loads((out / "protocol.json").read_text())
    assert result["split"]["seed"] == 3 and len(result["split"]["held_out"]) == 4
    assert result["chosen"] == "asd" and result["held_out"]["n_pairs"] == 4
    assert (out / "selection" / "results.json").is_file() and (out / "held-out" / "results.json").is_file()
    assert "Held-out (4 problems, judged once)" in (out / "protocol.md").read_text()
    # the plug-in's completions are all cut by max_tokens: the held-out split is never used
    cut = tmp_path / "cut"
    assert main(["--url", fake_service, "--suite", plugin, "--arms", "exact,asd", "--protocol", "--out", str(cut),
                 "--resamples", "200"]) == 1
    assert "max-tokens" in capsys.readouterr().err and not (cut / "held-out").exists()
