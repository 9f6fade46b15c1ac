"""`specserve eval`: run a task suite on several arms, score it, compare the arms paired by problem.

    specserve eval CONFIG      --suite humaneval --arms exact,asd [--limit N] [--out DIR]    (in-process)
    specserve eval --url URL   --suite humaneval-rewrite --arms exact,asd [--limit N]       (a running service)
    specserve eval --out DIR   --report-only                                                 (rebuild the report)
    specserve eval CONFIG      --suite arith --arms exact,a,b,c --protocol [--split-seed S]  (choose, then judge)

`--protocol` (`experiments.eval.protocol`): the arms answer a selection split, one is chosen by a fixed rule, and
the reference and the chosen arm answer the held-out split once; `DIR/protocol.json` and `DIR/protocol.md` hold
the split, the verdicts and the held-out figures (only these are to be quoted). In-process, each output's NLL
under the target is scored with the config's target (`--no-nll` skips it; over --url, `--nll-source SOURCE`).

Progress goes to stderr; rows are saved as they come and rerunning the same command resumes. Writes
`DIR/results.json`, `DIR/report.md`, `DIR/frontier.png` and prints the quality table. Exit status: 0 done; 1
stopped by failing requests (rerun to resume); 2 bad input (unknown suite or arm, unreachable URL, bad
arguments); 130 interrupted. `configure_parser(parser)` declares the arguments (`cluster.cli` mounts them as
`specserve eval`), `run(args)` runs them, and `main(argv)` parses them on its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from experiments.eval.stats import DEFAULT_RESAMPLES

DEFAULT_SUITE = "humaneval"
DEFAULT_OUT = "specserve-eval"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("config", nargs="?", help="YAML config to build a unit in-process (or use --url)")
    parser.add_argument("--url", help="a running service, e.g. http://127.0.0.1:8000 (the OpenAI API under /v1)")
    parser.add_argument("--model", help="model id to request over --url (default: the first of /v1/models)")
    parser.add_argument("--suite", default=DEFAULT_SUITE,
                        help="humaneval, humaneval-chat, humaneval-rewrite, an entry point of "
                             "specserve.eval_suites, or module:object (default %(default)s)")
    parser.add_argument("--arms", help="comma-separated arm names; the first is the reference unless --reference "
                                       "(default: the config's arms, or the service's)")
    parser.add_argument("--reference", help="arm the others are compared with (default: the first of --arms)")
    parser.add_argument("--limit", type=int, help="only the suite's first N problems")
    parser.add_argument("--max-tokens", type=int, help="override the suite's max_tokens per answer")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (default 0: greedy); each problem gets one seed, the "
                        "same on every arm, so the arms' draws are paired")
    parser.add_argument("--out", type=Path, help=f"output directory (default: {DEFAULT_OUT}/SUITE)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request (default %(default)s)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from DIR/rows.jsonl")
    parser.add_argument("--protocol", action="store_true",
                        help="choose an arm on a selection split, judge it once on the held-out split")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the selection/held-out split")
    parser.add_argument("--held-out-share", type=float, default=0.5, help="share of problems held out (0.5)")
    parser.add_argument("--margin", type=float, default=5.0,
                        help="score points an arm may lose on the selection split and stay eligible (5)")
    parser.add_argument("--no-nll", action="store_true", help="skip scoring each output's NLL under the target")
    parser.add_argument("--nll-source", help="target model to score NLL with (default: the config's target; "
                                             "over --url none unless given)")
    return parser


def _arms(text: str | None) -> list[str]:
    return [a.strip() for a in (text or "").split(",") if a.strip()]


def _report(out_dir: Path, reference: str | None, resamples: int, seed: int) -> int:
    from experiments.eval.report import build_eval_report, quality_section, write_outputs
    from experiments.eval.runner import read_rows, read_run_info

    info = read_run_info(out_dir)
    rows = read_rows(out_dir)
    if info is None or not rows:
        _say(f"specserve eval: no results in {out_dir}")
        return 2
    report = build_eval_report(rows, suite=info["suite"], binary=info.get("binary", True), arms=info.get("arms"),
                               reference=reference, arm_settings=info.get("arm_settings"), resamples=resamples,
                               seed=seed)
    paths = write_outputs(out_dir, report)
    sys.stdout.write(quality_section(report)["markdown"])
    _say("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run `specserve eval` for parsed arguments; returns the exit status (module docstring)."""
    from experiments.eval.backends import BackendError, BackendUnavailable, HTTPBackend, InProcessBackend
    from experiments.eval.runner import read_run_info, run_suite
    from experiments.eval.suites import load_suite

    arms = _arms(args.arms)
    reference = args.reference or (arms[0] if arms else None)
    if args.report_only:
        if args.out is None:
            _say("specserve eval: --report-only needs --out DIR")
            return 2
        try:
            return _report(args.out, reference, args.resamples, args.seed)
        except ValueError as err:
            _say(f"specserve eval: {err}")
            return 2
    if (args.config is None) == (args.url is None):
        _say("specserve eval: give either a CONFIG (in-process) or --url (a running service)")
        return 2
    try:
        suite = load_suite(args.suite)
    except ValueError as err:
        _say(f"specserve eval: {err}")
        return 2
    out_dir = args.out or Path(DEFAULT_OUT) / suite.name.replace("/", "_")
    backend = None
    try:
        backend = (HTTPBackend(args.url, args.model, timeout_s=args.timeout) if args.url
                   else InProcessBackend(args.config))
        if not arms:
            previous = read_run_info(out_dir)
            arms = (previous or {}).get("arms") or (list(backend.arm_settings() or {}) if not args.url
                                                     else backend.default_arms())
            if not arms:
                raise ValueError("arms: the service does not list its arms; give --arms")
            reference = reference or arms[0]
        if reference not in arms:
            raise ValueError(f"reference: {reference!r} is not one of --arms {arms}")
        likelihood = _likelihood(args)
        if args.protocol:
            return _protocol(suite, backend, arms, reference, out_dir, args, likelihood)
        info = run_suite(suite, backend, arms, out_dir, limit=args.limit, max_tokens=args.max_tokens,
                         temperature=args.temperature, progress=_say, likelihood=likelihood)
    except BackendUnavailable as err:
        _say(f"specserve eval: {err}")
        return 2
    except BackendError as err:
        _say(f"specserve eval: stopped: {err}")
        _report_quietly(out_dir, reference, args)
        return 1
    except (ValueError, FileNotFoundError) as err:
        _say(f"specserve eval: {err}")
        return 2
    except KeyboardInterrupt:
        _say(f"specserve eval: interrupted; rows so far are in {out_dir}, rerun the same command to resume")
        return 130
    finally:
        if backend is not None:
            backend.close()
    _say(f"{info.written} answers now, {info.resumed} from earlier runs, {info.errors} failed requests, "
         f"{info.seconds:.0f} s")
    code = _report(out_dir, reference, args.resamples, args.seed)
    if info.errors:
        _say(f"specserve eval: {info.errors} requests failed; rerun the same command to retry them")
        return 1
    return code


def _likelihood(args: argparse.Namespace):
    """The NLL scorer: the config's target in-process, `--nll-source` over --url; None with --no-nll."""
    if args.no_nll:
        return None
    source = args.nll_source
    if source is None and args.config is not None:
        from cluster.config import load_config

        source = load_config(Path(args.config)).target.source
    if source is None:
        return None
    from experiments.eval.likelihood import TargetLikelihood

    return TargetLikelihood(source).nll


def _protocol(suite, backend, arms, reference, out_dir: Path, args: argparse.Namespace, likelihood) -> int:
    from experiments.eval.protocol import ProtocolError, protocol_markdown, run_protocol

    if args.temperature:
        raise ValueError("temperature: the protocol compares greedy arms; drop --temperature")
    try:
        result = run_protocol(suite, backend, arms, out_dir, reference=reference, limit=args.limit,
                              split_seed=args.split_seed, held_out_share=args.held_out_share,
                              margin=args.margin / 100, max_tokens=args.max_tokens, likelihood=likelihood,
                              resamples=args.resamples, seed=args.seed, progress=_say)
    except ProtocolError as err:
        _say(f"specserve eval: protocol stopped: {err}")
        return 1
    text = protocol_markdown(result)
    (out_dir / "protocol.md").write_text(text)
    sys.stdout.write(text)
    return 0


def _report_quietly(out_dir: Path, reference: str | None, args: argparse.Namespace) -> None:
    """The report of what a stopped run got done, when there is any."""
    try:
        _report(out_dir, reference, args.resamples, args.seed)
    except (ValueError, OSError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """`specserve eval ...`; argv are the arguments after `eval`."""
    parser = argparse.ArgumentParser(prog="specserve eval", description=__doc__.split("\n\n")[0])
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
