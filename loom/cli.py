"""The ``loom`` command line: one flat typer app, one function per command.

Any `LoomError` a command raises is printed as a single red ``error:`` line on stderr and the
process exits with status 1; only bugs produce a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

import loom
from loom.config import SPECULATIVE_METHODS
from loom.errors import LoomError
from loom.loader import registry

# piped or redirected output (bench tables into files) gets a wide page instead of 80 columns
out = Console() if sys.stdout.isatty() else Console(width=160)
err = Console(stderr=True)


class _LoomGroup(TyperGroup):
    """Turns LoomErrors from any command into a one-line message and exit status 1, and Ctrl-C
    into a one-line "interrupted" and status 130. The interrupt is caught here: typer turns a
    KeyboardInterrupt that reaches it into a silent exit 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LoomError as e:
            err.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/red]")
            raise typer.Exit(130) from None
        except RuntimeError as e:   # Ctrl-C inside an import's class creation arrives wrapped in one
            if not _interrupted(e):
                raise
            err.print("[red]interrupted[/red]")
            raise typer.Exit(130) from None


def _interrupted(e: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the causes of `e`."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False



def _flag(default: bool, *names: str, **kw: Any) -> Any:
    """A boolean option, shown without the `<bool>` that typer writes for a value it takes none of."""
    return typer.Option(default, *names, metavar="", **kw)

app = typer.Typer(
    cls=_LoomGroup,
    name="loom",
    help="loom: LLM inference and serving on CPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        print(f"loom {loom.__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = _flag(False, "--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print loom's version and exit.")) -> None:
    """loom: LLM inference and serving on CPUs."""


@app.command()
def pull(
    name: str = typer.Argument(registry.DEFAULT_MODEL, help="Registry model name (see `loom models`)."),
    force: bool = _flag(False, "--force", help="Download again even if the cache holds the model."),
    quiet: bool = _flag(False, "--quiet", "-q", help="No progress display."),
) -> None:
    """Download a registry model into the cache and print its path."""
    path = registry.pull(name, progress=not quiet, force=force)
    print(path)


@app.command()
def models() -> None:
    """List the registry's models and whether each is in the cache."""
    table = Table(title=f"models (cache: {registry.models_dir()})", title_justify="left")
    for column in ("name", "size", "cached", "description"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for name, entry in sorted(registry.REGISTRY.items()):
        path = registry.cached_path(name)
        if registry.is_cached(name):
            cached = "[green]yes[/green]"
        elif path.exists():
            cached = "[yellow]invalid[/yellow] (run loom pull)"
        else:
            cached = "no"
        label = f"{name} (default)" if name == registry.DEFAULT_MODEL else name
        table.add_row(label, f"{entry.size / 1e6:.0f} MB", cached, entry.description)
    out.print(table)


def _int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise LoomError(f"{flag}: expected comma-separated integers, got {text!r}") from None


# The options of each `loom bench` mode (besides the common ones): one given on the command line
# to a mode that does not read it is refused, never silently ignored.
_BENCH_COMMON = {"model", "threads", "json_path", "plot", "quick", "prompts"}
_BENCH_MODES = {
    "server": ("a load test (--server)", {"server", "peers", "rates", "num_requests", "rounds", "duration", "max_concurrency",
                                          "endpoint", "temperature", "top_p", "ignore_eos", "max_tokens"}),
    "spec": ("--spec", {"spec", "dtype", "spec_prompts", "spec_methods", "spec_repeats", "spec_datastore", "spec_llamacpp",
                        "markdown", "max_tokens"}),
    "peers": ("the peer suites (without --server or --spec)",
              {"peers", "dtype", "kv_cache_dtype", "decode_context", "concurrency", "decode_tokens", "prefill_tokens",
               "max_tokens", "parallel", "parallel_n", "limit"}),
}


def _refuse_unread_bench_options(ctx: typer.Context, mode: str) -> None:
    name, read = _BENCH_MODES[mode]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        given = source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
        if given and param.name not in read and param.name not in _BENCH_COMMON:
            flag = max(param.opts, key=len)
            users = [desc for m, (desc, names) in _BENCH_MODES.items() if param.name in names]
            raise LoomError(f"{flag} has no effect in {name}" + (f": it is for {' and '.join(users)}" if users else ""))


def _check_peer_options(peers: str | None, dtype: str | None, kv_cache_dtype: str | None, parallel: bool,
                        limit: int | None, parallel_n: str | None) -> None:
    """Options of the peer suites that the run would not read are refused, never ignored."""
    named = [p.strip() for p in peers.split(",")] if peers else None
    if dtype is not None and named is not None and "loom" not in named:
        raise LoomError("--dtype sets the plain `loom` peer, which --peers does not name (loom:DTYPE names one)")
    if kv_cache_dtype is not None and named is not None and not any(p.split(":")[0] == "loom" for p in named):
        raise LoomError("--kv-cache-dtype sets loom's peers, and --peers names none")
    for value, flag in ((limit, "--limit"), (parallel_n, "--parallel-n")):
        if value is not None and not parallel:
            raise LoomError(f"{flag} sets the parallel-sampling suites: it needs --parallel")


def _check_bench_outputs(json_path: Path | None, markdown: Path | None, plot: Path | None) -> None:
    """Output paths that would fail only after the run are one line before it (missing parent
    directories are made, as the report writers make them)."""
    if json_path is not None and markdown is not None and json_path.absolute() == markdown.absolute():
        raise LoomError(f"--json and --markdown name the same file ({json_path}): one would overwrite the other")
    for path, flag in ((json_path, "--json"), (markdown, "--markdown")):
        if path is not None:
            try:
                path.absolute().parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise LoomError(f"{flag} {path}: cannot make its directory: {e.strerror or e}") from None
            _check_writable(path, flag)
    if plot is not None and plot.exists() and not plot.is_dir():
        raise LoomError(f"--plot {plot}: is a file; --plot names the directory the charts go into")


SPEC_CONFIG_HELP = ('Speculative decoding as JSON, e.g. \'{"method": "auto"}\' (methods: '
                    f'{", ".join(SPECULATIVE_METHODS)}).')
SPEC_DATASTORE_HELP = ("A corpus the retrieval drafter copies from: a text file or a directory of them (.jsonl: each "
                       "line's \"text\"); alone it turns on method retrieval, with --speculative-config it adds "
                       "the corpus to that method.")


@app.command(short_help="Measure loom against its peers on the same machine (speed, throughput, latency, RSS, "
                        "load time); with --server, load-test a server.")
def bench(
    ctx: typer.Context,
    model: str = typer.Option(registry.DEFAULT_MODEL, "--model", "-m", help="Registry model name or GGUF path."),
    threads: int | None = typer.Option(None, "--threads", "-t", min=1,
                                       help="Threads for every engine (default: physical cores)."),
    peers: str | None = typer.Option(None, "--peers",
                                     help="Engines to measure, comma-separated: loom, loom:DTYPE (e.g. loom:float32), "
                                          "loom:kv=KV or loom:DTYPE+kv=KV (a KV cache dtype, e.g. loom:kv=int8), "
                                          "transformers, llama.cpp (default: all three). Missing packages are "
                                          "reported as skipped. With --server: servers the bench starts on the "
                                          "same GGUF and load-tests in turn: loom, llama-server, vllm, and engine "
                                          "(loom's engine alone under the same load, no server)."),
    dtype: str | None = typer.Option(None, "--dtype", help="dtype of the plain `loom` peer (default: loom's)."),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype",
                                              help="KV cache of the loom peers that name none (auto, float32, "
                                                   "float16, int8, int4; a peer can name its own: loom:kv=int8)."),
    decode_context: str | None = typer.Option(None, "--decode-context",
                                              help="Also time single-stream decode after prompts of these "
                                                   "lengths, comma-separated (e.g. 256,2048,6000)."),
    concurrency: str | None = typer.Option(None, "--concurrency",
                                           help="Concurrent request counts (default: 1,4,16,32,64; quick: 1,4)."),
    decode_tokens: int | None = typer.Option(
        None, "--decode-tokens", min=2, help="New tokens of the single-stream decode run (default: 128; quick: 16)."),
    prefill_tokens: int | None = typer.Option(None, "--prefill-tokens", min=1,
                                              help="Prompt length of the prefill run (default: 512; quick: 64)."),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=2, help="New tokens per request in the concurrency runs (default: 64; quick: 8); with --spec: "
                              "per request of every run (default: 128; quick: 32)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the full report as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write PNG charts into this directory."),
    quick: bool = _flag(False, "--quick", help="A small smoke run (short runs, concurrency 1,4)."),
    prompts: Path | None = typer.Option(None, "--prompts", help="Spec-Bench question.jsonl to draw prompts from."),
    spec: bool = _flag(False, "--spec", help="Speculative decoding per Spec-Bench category instead of the "
                              "peer suites: speedups single-stream and at 8 concurrent, vs llama.cpp's prompt lookup."),
    spec_prompts: int | None = typer.Option(None, "--spec-prompts", min=1,
                                            help="With --spec: prompts per category (default 4; quick: 1)."),
    spec_methods: str | None = typer.Option(None, "--spec-methods",
                                            help="With --spec: methods, comma-separated (default: "
                                                 "prompt_lookup,token_recycling,lookahead,retrieval,auto)."),
    spec_repeats: int | None = typer.Option(None, "--spec-repeats", min=1,
                                            help="With --spec: runs of every engine, in turns of one step; "
                                                 "speedups: their median paired ratio (default 2; quick: 1)."),
    spec_datastore: str | None = typer.Option(None, "--spec-datastore", metavar="PATH",
                                              help="With --spec: the corpus of methods retrieval and auto."),
    spec_llamacpp: bool = _flag(True, "--spec-llamacpp/--no-spec-llamacpp",
                                       help="With --spec: also time llama.cpp with its prompt lookup (if installed)."),
    markdown: Path | None = typer.Option(None, "--markdown",
                                         help="With --spec: write the docs/benchmarks.md section here."),
    parallel: bool = _flag(False, "--parallel",
                                  help="Also run the parallel sampling suites: cost of n = 1,4,8,16 completions "
                                       "with and without prompt sharing, and GSM8K accuracy (see --limit)."),
    parallel_n: str | None = typer.Option(None, "--parallel-n",
                                          help="Completions per prompt of the --parallel cost runs (default: "
                                               "1,4,8,16; quick: 1,4)."),
    limit: int | None = typer.Option(None, "--limit", min=0,
                                     help="GSM8K problems of the --parallel quality suite (default 200; quick: 2; "
                                          "0 skips it)."),
    server: str | None = typer.Option(None, "--server", metavar="URL|start",
                                      help="Load-test a running OpenAI-compatible server at URL instead (Poisson "
                                           "arrivals at each of --rates; key from $OPENAI_API_KEY); 'start': only "
                                           "the servers of --peers, started by the bench."),
    rates: str | None = typer.Option(None, "--rates",
                                     help="--server: request rates in req/s, 'max' = all at once "
                                          "(default: 0.25,0.5,1,2,4,8,max; quick: 1,max)."),
    num_requests: str | None = typer.Option(None, "--num-requests",
                                            help="--server: requests per rate (default: 32; quick: 4); several "
                                                 "counts, comma-separated, run the ladder once each."),
    rounds: int = typer.Option(1, "--rounds", min=1,
                               help="--server with --peers: interleaved rounds over the servers (ratios are the "
                                    "median of each round's)."),
    duration: float | None = typer.Option(None, "--duration", min=0.001,
                                          help="--server: send rate x SECONDS requests per rate instead."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", min=1,
                                               help="--server: at most N requests in flight (with --rates max and "
                                                    "more requests than N: N streams held busy)."),
    endpoint: str = typer.Option("auto", "--endpoint",
                                 help="--server: the API every request goes to: chat (/v1/chat/completions), "
                                      "completions (/v1/completions, the prompt as plain text) or auto: "
                                      "completions for a model without a chat template (from the GGUF of "
                                      "--model when the bench starts servers, else the server's /tokenizer_info)."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0,
                                      help="--server: every request's sampling temperature (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="--server: every request's top_p, with --temperature > 0 "
                                "(sampled requests also send top_k -1 and min_p 0: one distribution on every server)."),
    ignore_eos: bool = _flag(False, "--ignore-eos",
                                    help="--server: every request generates exactly --max-tokens (ignore_eos, "
                                         "which loom, vLLM and llama-server take), the same work on every server."),
) -> None:
    """Measure loom and its peers in one run on the same GGUF and thread count, each engine in its own
    process: decode and prefill speed, throughput and latency under concurrency, peak RSS, load time.
    With --server URL: a load test of a running server from this process."""
    mode = "server" if server is not None else "spec" if spec else "peers"
    _refuse_unread_bench_options(ctx, mode)
    if rounds != 1 and not peers:
        raise LoomError("--rounds interleaves the servers of --peers: it needs --peers")
    if mode == "peers":
        _check_peer_options(peers, dtype, kv_cache_dtype, parallel, limit, parallel_n)
    _check_bench_outputs(json_path, markdown, plot)
    for stop in (signal.SIGTERM, signal.SIGHUP):   # a stop, or the terminal closed: what it started stops with it
        signal.signal(stop, _interrupt)
    if server is not None:  # three modes: a load test of a server, speculative decoding, the peer suites
        from loom.bench.load_command import run_load_command

        run_load_command(server, model=model, rates=rates, num_requests=_int_list(num_requests, "--num-requests"),
                         duration=duration, max_tokens=max_tokens, quick=quick, prompts=prompts, json_path=json_path,
                         plot=plot, out=out, err=err, peers=peers, rounds=rounds, threads=threads,
                         max_concurrency=max_concurrency, endpoint=endpoint, ignore_eos=ignore_eos,
                         temperature=temperature, top_p=top_p,
                         model_given=ctx.get_parameter_source("model").name == "COMMANDLINE")
        return
    from loom.bench.prompts import SPEC_BENCH_PATH
    from loom.config import physical_cores

    threads, prompts = threads or physical_cores(), prompts or SPEC_BENCH_PATH
    if spec:
        _spec_bench(model, threads, prompts, quick, dtype, json_path, markdown, spec_prompts, spec_methods,
                    spec_repeats, spec_datastore, spec_llamacpp, max_tokens, plot)
        return
    contexts = _int_list(decode_context, "--decode-context")
    _peer_bench(model, threads, prompts, peers or "loom,transformers,llama.cpp", dtype, quick, json_path, plot,
                parallel, kv_cache_dtype, contexts,
                concurrency=_int_list(concurrency, "--concurrency"), decode_tokens=decode_tokens,
                prefill_tokens=prefill_tokens, max_tokens=max_tokens, quality_limit=limit,
                parallel_n=_int_list(parallel_n, "--parallel-n"))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _peer_bench(model: str, threads: int, prompts: Path, peers: str, dtype: str | None, quick: bool,
                json_path: Path | None, plot: Path | None, parallel: bool, kv_cache_dtype: str | None = None,
                contexts: tuple[int, ...] | None = None, **overrides) -> None:
    """The peer suites: decode, prefill, concurrency (and with --parallel the parallel sampling suites)."""
    from loom.bench.harness import BenchRequest, run_bench
    from loom.bench.peers import parse_peers
    from loom.bench.report import print_report, write_json
    from loom.bench.settings import BenchSettings

    settings = BenchSettings.preset(quick).replace(**overrides)
    if parallel:
        from loom.bench.suites import PARALLEL_SUITES

        wanted = PARALLEL_SUITES if settings.quality_limit else PARALLEL_SUITES[:1]
        settings = settings.replace(suites=settings.suites + tuple(wanted))
    if contexts:
        settings = settings.replace(decode_contexts=contexts, suites=settings.suites + ("decode_context",))
    specs = [s.with_option("dtype", dtype) if s.label == "loom" and dtype else s for s in parse_peers(peers)]
    if kv_cache_dtype:
        specs = [s.with_option("kv_cache_dtype", kv_cache_dtype)
                 if s.is_loom and "kv_cache_dtype" not in s.options else s for s in specs]
    report = run_bench(BenchRequest(model=model, peers=specs, settings=settings, threads=threads, prompts_path=prompts),
                       console=err)
    print_report(report, out)
    if json_path is not None:
        write_json(report, json_path)
        out.print(f"report written to {escape(str(json_path))}")
    if plot is not None:
        from loom.bench.plots import write_plots

        for path in write_plots(report, plot):
            out.print(f"plot written to {escape(str(path))}")


def _spec_bench(model: str, threads: int, prompts: Path, quick: bool, dtype: str | None, json_path: Path | None,
                markdown: Path | None, per_category: int | None, methods: str | None,
                repeats: int | None, datastore: str | None, llamacpp: bool = True,
                max_tokens: int | None = None, plot: Path | None = None) -> None:
    from loom.bench.spec_bench import METHODS, SpecBenchSettings, run_spec_bench, spec_lines, write_plots
    from loom.bench.report import write_output
    from loom.bench.settings import BenchError

    settings = SpecBenchSettings.preset(quick)
    if dtype:
        settings = dataclasses.replace(settings, dtype=dtype)
    if per_category:
        settings = dataclasses.replace(settings, prompts_per_category=per_category)
    if repeats:
        settings = dataclasses.replace(settings, repeats=repeats)
    if datastore:
        settings = dataclasses.replace(settings, datastore=datastore)
    settings = dataclasses.replace(settings, llamacpp=llamacpp)
    if max_tokens:
        settings = dataclasses.replace(settings, max_tokens=max_tokens)
    if methods:
        chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
        unknown = [m for m in chosen if m not in METHODS + ("draft_model",)]
        if unknown or not chosen:
            raise BenchError(f"--spec-methods: unknown method(s) {', '.join(unknown) or '(none given)'} "
                             f"(choices: {', '.join(METHODS + ('draft_model',))})")
        settings = dataclasses.replace(settings, methods=chosen)
    report = run_spec_bench(model, threads, prompts, settings, log=lambda m: err.print(escape(m)))
    text = "\n".join(spec_lines(report))
    out.print(escape(text))
    if json_path is not None:
        write_output(json_path, json.dumps(report, indent=2) + "\n")
    if markdown is not None:
        write_output(markdown, text + "\n")
    if plot is not None:
        for path in write_plots(report, plot):
            out.print(f"plot written to {escape(str(path))}")


@app.command()
def serve(
    model: str = typer.Argument(registry.DEFAULT_MODEL, help="Registry model name or path to a .gguf file."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 exposes the server to the network."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="LOOM_API_KEY",
                                       help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/*, "
                                            "/tokenize, /detokenize, /tokenizer_info and llama-server's /completion, "
                                            "/apply-template, /props (/health, /metrics and the playground stay "
                                            "open)."),
    served_model_name: str | None = typer.Option(
        None, help="Name clients send as `model` (default: the registry name, or the .gguf file stem)."),
    threads: int | None = typer.Option(None, "--threads", "-t", min=1, help="CPU threads (default: physical cores)."),
    dtype: str | None = typer.Option(None, help="float32 (exact), bfloat16 or auto (fastest); "
                                                "default: the engine's default."),
    max_num_seqs: int | None = typer.Option(None, min=1, help="Sequences running at once."),
    max_num_batched_tokens: int | None = typer.Option(None, min=1, help="Token budget of one engine step."),
    max_waiting: int | None = typer.Option(None, min=1,
                                           help="Bound of the waiting queue; a request beyond it gets 429."),
    max_model_len: int | None = typer.Option(None, min=2, help="Context limit (default: the model's)."),
    kv_cache_memory: int | None = typer.Option(None, min=1,
                                               help="Bytes for the KV cache (default: a share of free RAM)."),
    num_blocks: int | None = typer.Option(None, min=1, help="KV blocks (overrides --kv-cache-memory)."),
    block_size: int | None = typer.Option(None, min=1, help="Tokens per KV block."),
    prefix_caching: bool = _flag(True, "--prefix-caching/--no-prefix-caching",
                                        help="Reuse the KV of shared prompt prefixes."),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype",
                                              help="KV cache: auto (float16 on loom's kernels, float32 in the "
                                                   "exact mode), float32, float16, int8, int4."),
    seed: int = typer.Option(0, help="Seed of unseeded sampling."),
    speculative_config: str | None = typer.Option(None, "--speculative-config", help=SPEC_CONFIG_HELP),
    spec_datastore: str | None = typer.Option(None, "--spec-datastore", metavar="PATH", help=SPEC_DATASTORE_HELP),
    kv_eviction: str | None = typer.Option(
        None, "--kv-eviction", help='Default KV eviction of requests as JSON, e.g. \'{"policy": "streaming", '
                                    '"budget": 1024}\' (policies: streaming, snapkv; a request\'s own '
                                    'kv_eviction wins, {"policy": "none"} opts out).'),
    max_tokens_limit: int | None = typer.Option(None, min=1,
                                                help="Largest max_tokens a request may ask for (larger: 400)."),
    chat_template: str | None = typer.Option(
        None, "--chat-template", help="A Jinja chat template in place of the model's: a file, or the template "
                                      "itself (a base model without one then takes chat requests)."),
    max_body_bytes: int = typer.Option(2 << 20, min=1, help="Largest request body in bytes (larger: 413)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    access_log: bool = _flag(True, "--access-log/--no-access-log", help="Log one line per request."),
    allowed_origins: str = typer.Option("*", help="Origins whose browser pages may call the API (CORS), "
                                                  "comma-separated; '*' every origin, '' none."),
    allow_credentials: bool = _flag(False, "--allow-credentials",
                                           help="Let cross-origin pages send cookies and credentials."),
    engine_process: bool = _flag(True, "--engine-process/--no-engine-process",
                                        help="Run the engine in its own process (the HTTP front end in this "
                                             "one); --no-engine-process keeps it on a thread here."),
    engine_restarts: int | None = typer.Option(None, "--engine-restarts", min=0,
                                               help="Start a new engine process when it dies, at most N times in "
                                                    "10 minutes (default 3; 0: never; the server then answers 503 "
                                                    "until restarted)."),
    replicas: int | None = typer.Option(
        None, "--replicas", help="Serve with N engine replicas on Ray Serve behind this endpoint (threads per "
                                 "replica: --threads, default cores / N); see docs/cluster.md."),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="With --replicas: join the Ray cluster at HOST:PORT (default: start a local "
                                    "Ray for this command)."),
    min_replicas: int | None = typer.Option(None, "--min-replicas", help="Ray Serve autoscaling: fewest replicas."),
    max_replicas: int | None = typer.Option(None, "--max-replicas", help="Ray Serve autoscaling: most replicas."),
    target_ongoing_requests: float | None = typer.Option(
        None, "--target-ongoing-requests", help="Ray Serve autoscaling: requests in flight per replica to aim at."),
    autoscaling_config: str | None = typer.Option(
        None, "--autoscaling-config", help="Ray Serve autoscaling: further autoscaling_config keys as JSON, e.g. "
                                           "'{\"upscale_delay_s\": 5}'."),
    router: str | None = typer.Option(None, "--router",
                                      help="With --replicas: prefix-aware (the default: longest cached prompt "
                                           "prefix when loads are balanced) or power-of-two (Ray Serve's default)."),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, with a web playground at /."""
    from loom.config import EngineConfig

    if log_level not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter(f"expected debug, info, warning or error, got {log_level!r}",
                                 param_hint="--log-level")
    cluster = _cluster_options(replicas, threads, ray_address, min_replicas, max_replicas,
                               target_ongoing_requests, router, _json_option(autoscaling_config, "--autoscaling-config"))
    _refuse_other_modes(cluster, router, engine_restarts, engine_process)
    if cluster is not None:
        threads = cluster.threads
    config = EngineConfig.create(model, dtype=dtype, threads=threads, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting,
                                 max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                                 num_blocks=num_blocks, block_size=block_size,
                                 enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype, seed=seed,
                                 kv_eviction=_json_option(kv_eviction, "--kv-eviction"),
                                 speculative_config=_speculative(speculative_config, spec_datastore))
    if cluster is None and engine_process:
        _start_engine_fork_server()
    front = dict(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                 max_tokens_limit=max_tokens_limit, max_body_bytes=max_body_bytes, log_level=log_level,
                 access_log=access_log, cors=_cors(allowed_origins, allow_credentials),
                 chat_template=_chat_template(chat_template))
    if cluster is not None:
        from loom.cluster.launch import run_cluster

        return run_cluster(config, cluster, **front)
    _serve_here(config, engine_process, front, engine_restarts)


def _refuse_other_modes(cluster, router: str | None, engine_restarts: int | None, engine_process: bool) -> None:
    """Options of another way of serving are refused, never ignored."""
    if cluster is None and router is not None:
        raise typer.BadParameter("applies with --replicas (a cluster's router)", param_hint="--router")
    if engine_restarts is not None and (not engine_process or cluster is not None):
        raise typer.BadParameter("applies to a server whose engine runs in its own process (not with "
                                 "--no-engine-process or --replicas)", param_hint="--engine-restarts")


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template as given; checked to compile before the
    model loads."""
    if value is None:
        return None
    path = Path(value).expanduser()
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path and not path.is_file():
        raise LoomError(f"--chat-template {value}: no such file (give a template file, or the template itself)")
    source = path.read_text() if looks_like_path else value
    if not source.strip():   # it would render every conversation as nothing
        raise LoomError(f"--chat-template {value}: the template is empty")
    from loom.loader.chat_template import ChatTemplate

    ChatTemplate(source, given_as="--chat-template")   # TokenizerError (one line) when it does not compile
    return source


def _cors(origins: str, credentials: bool):
    from loom.server.limits import Cors

    listed = tuple(o.strip() for o in origins.split(",") if o.strip())
    if credentials and "*" in listed:
        raise typer.BadParameter("credentials cannot go to every origin ('*'): name the origins",
                                 param_hint="--allowed-origins")
    return Cors(listed, credentials)


def _start_engine_fork_server() -> None:
    """The fork server the engine process is forked from (`ProcessEngineClient` uses it), started
    before this process imports anything of the HTTP front end (loom.server, even for its CORS
    settings): that process imports the engine while this one imports the front end, so the two
    imports (~3-4 s each on a slow VM) overlap instead of running one after the other.

    It starts with SIGINT ignored (an ignored signal stays ignored in the program a process
    executes, and Python then installs no KeyboardInterrupt handler; a blocked one would not
    stay blocked: multiprocessing's spawn resets the mask): the fork server ignores SIGINT only
    once its imports are done, so a Ctrl-C to the terminal's process group during a start
    printed a traceback from inside torch's import. This process answers Ctrl-C, but for the
    ~10 ms of the spawn."""
    import multiprocessing.forkserver
    import signal

    from loom.server.engine_client import engine_process_context

    engine_process_context()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve_here(config, engine_process: bool, front: dict[str, Any], engine_restarts: int | None) -> None:
    """One server on this machine (the engine's fork server already started, see above)."""
    from loom.server.serve import run_server

    restarts = {} if engine_restarts is None else {"engine_restarts": engine_restarts}   # None: run_server's default
    run_server(config, engine_process=engine_process, **restarts, **front)


def _cluster_options(replicas, threads, ray_address, min_replicas, max_replicas, target_ongoing_requests, router,
                     autoscaling_extra):
    """The ClusterConfig of `loom serve --replicas ...` (checked before Ray starts), or None for one server."""
    from loom.config import physical_cores

    if replicas is None and ray_address is None and (min_replicas, max_replicas, target_ongoing_requests,
                                                     autoscaling_extra) == (None, None, None, None):
        return None
    from loom.cluster.config import ClusterConfig

    count = replicas if replicas is not None else 1
    threads = threads if threads is not None else max(1, physical_cores() // max(1, count))
    cluster = ClusterConfig(replicas=count, threads=threads, ray_address=ray_address, min_replicas=min_replicas,
                            max_replicas=max_replicas, target_ongoing_requests=target_ongoing_requests,
                            router=router or "prefix-aware",
                            autoscaling_extra=_autoscaling_extra(autoscaling_extra))
    cluster.check_before_ray()
    return cluster


def _autoscaling_extra(value) -> tuple:
    """--autoscaling-config's JSON object as ClusterConfig's sorted (key, value) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise typer.BadParameter("expected a JSON object", param_hint="--autoscaling-config")
    return tuple(sorted(value.items()))


def _json_option(text: str | None, flag: str):
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise typer.BadParameter(f"expected a JSON object, got {text!r} ({e})", param_hint=flag) from None


def _speculative(text: str | None, datastore: str | None):
    """--speculative-config JSON with --spec-datastore merged in (alone it means method retrieval)."""
    spec = _json_option(text, "--speculative-config")
    if datastore is None:
        return spec
    if spec is None:
        return {"method": "retrieval", "datastore": datastore}
    if not isinstance(spec, dict):
        return spec          # refused by the config, naming what it expects
    return spec | {"datastore": datastore}


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (with --chat: the user's message)."),
    model: str = typer.Option(registry.DEFAULT_MODEL, "--model", "-m",
                              help="Registry model name or path to a .gguf file."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 decodes greedily."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most probable tokens (0: all)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the request's sampler (reproducible output)."),
    chat: bool = _flag(False, "--chat", help="Wrap the prompt as a user message in the model's chat template."),
    threads: int | None = typer.Option(None, "--threads", "-t", help="CPU threads (default: physical cores)."),
    ignore_eos: bool = _flag(False, "--ignore-eos", help="Keep generating past end-of-sequence."),
    speculative_config: str | None = typer.Option(None, "--speculative-config", help=SPEC_CONFIG_HELP),
    spec_datastore: str | None = typer.Option(None, "--spec-datastore", metavar="PATH", help=SPEC_DATASTORE_HELP),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype",
                                              help="KV cache: auto, float32, float16, int8, int4."),
    chat_template: str | None = typer.Option(None, "--chat-template",
                                             help="With --chat: a Jinja chat template (a file, or the template "
                                                  "itself) in place of the model's (a base model has none)."),
) -> None:
    """Generate a completion for one prompt, streaming text to stdout as it is produced."""
    from loom.config import EngineConfig
    from loom.sampling_params import SamplingParams

    # the options are checked before the engine (and torch) is imported: a bad one fails at once
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            max_tokens=max_tokens, ignore_eos=ignore_eos)
    config = EngineConfig.create(model, threads=threads, kv_cache_dtype=kv_cache_dtype,
                                 speculative_config=_speculative(speculative_config, spec_datastore))
    if chat_template is not None and not chat:
        raise LoomError("--chat-template applies with --chat (the prompt as a user message)")
    template = _chat_template(chat_template)
    from loom.engine.engine import Engine

    engine = Engine(config)
    if template is not None:
        engine.tokenizer.set_chat_template(template)
    if chat:
        if engine.tokenizer.chat_template is None:
            raise LoomError(f"model '{model}' has no chat template (a base model): drop --chat to continue the "
                            "prompt as text, or give one with --chat-template")
        messages = [{"role": "user", "content": prompt}]
        request = {"prompt": engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   "prompt_token_ids": engine.tokenizer.encode_chat(messages)}
    else:
        request = prompt
    engine.add_request(request, params)
    _stream(engine, sys.stdout)


def _stream(engine, stream) -> None:
    """Writes each text delta of the engine's request as it comes, then a newline; Ctrl-C still
    ends a partial output with its newline (the shell prompt and the message start a line)."""
    streamed = False
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                delta = output.outputs[0].delta_text
                if delta:
                    streamed = True    # before the write: Ctrl-C may land inside it
                    stream.write(delta)
                    stream.flush()
    except KeyboardInterrupt:
        if streamed:
            stream.write("\n")
            stream.flush()
        raise
    stream.write("\n")
    stream.flush()


@app.command(name="eval", short_help="Perplexity of a text file; with --kld, the KL divergence from a "
                                      "reference run.")
def eval_(
    model: str = typer.Argument(registry.DEFAULT_MODEL, help="Registry model name or path to a .gguf file."),
    file: Path = typer.Option(..., "--file", "-f", help="Text file to score (UTF-8)."),
    context: int = typer.Option(512, "--context", "-c", help="Tokens per window."),
    stride: int | None = typer.Option(None, "--stride",
                                      help="Tokens between window starts (default: half the context); each "
                                           "token is scored once, with at least context - stride before it."),
    chunks: int | None = typer.Option(None, "--chunks", help="Score only the first N windows."),
    engine: str = typer.Option("loom", "--engine", help="Who computes: loom, or llama.cpp over the same tokens."),
    dtype: str = typer.Option("auto", "--dtype", help="loom's dtype: auto, float32 or bfloat16."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype",
                                       help="loom's KV cache: auto, float32, float16, int8, int4; with "
                                            "--engine llama.cpp its cache type, with flash attention: f16, q8_0, q4_0."),
    kv_eviction: str | None = typer.Option(
        None, "--kv-eviction", help='Score with KV eviction, as JSON (e.g. \'{"policy": "streaming", "budget": 512}\'); '
                                    'snapkv compresses each window\'s first context - stride tokens.'),
    kld: bool = _flag(False, "--kld", help="Also compare with a reference: KL divergence, top-token "
                                                  "agreement, probability shift."),
    base: Path | None = typer.Option(None, "--base", help="Reference saved with --save-base (implies --kld; "
                                                          "default reference: loom float32, computed alongside)."),
    save_base: Path | None = typer.Option(None, "--save-base", help="Save this run's log-probabilities into "
                                                                    "this directory, as a reference for later runs."),
    threads: int | None = typer.Option(None, "--threads", "-t", help="CPU threads (default: physical cores)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the figures as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG histogram of per-token KLD here."),
) -> None:
    """Perplexity of a text file with sliding windows; with --kld, the KL divergence from a reference
    run (as llama-perplexity --kl-divergence does)."""
    _check_eval_outputs(json_path, plot, kld or base is not None, save_base)
    if base is not None and save_base is not None and base.resolve() == save_base.resolve():
        raise LoomError(f"--base and --save-base name the same directory ({base}): save this run elsewhere")
    if engine != "loom" and dtype != "auto":
        raise LoomError(f"--dtype is loom's; --engine {engine} runs the GGUF's own types")
    from loom import eval as ev
    from loom.eval import report

    text = _read_text(file)
    tokenizer, limit = ev.sources.tokenizer_for(model)
    if limit is not None and context > limit:
        raise LoomError(f"--context {context} is longer than the model's context length of {limit} tokens")
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    windows = ev.Windows.build(ids, context, stride, bos, chunks)
    if engine == "loom":
        source = ev.open_source("loom", model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, threads=threads,
                                kv_eviction=_json_option(kv_eviction, "--kv-eviction"),
                                prompt_tokens=windows.context - windows.stride)
    else:
        if kv_eviction is not None:
            raise typer.BadParameter(f"--kv-eviction is loom's; --engine {engine} cannot use it",
                                     param_hint="--kv-eviction")
        kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
        source = ev.open_source(engine, model=model, context=context, threads=threads, **kv)
    reference = None
    if base is not None:
        reference = ev.sources.BaseSource(base, windows)
    elif kld:
        reference = ev.open_source("loom", model=model, dtype="float32", threads=threads)
    result = _evaluate(ev, windows, source, reference, save_base, context)
    result.info.update(model=model, file=str(file), context=windows.context, stride=windows.stride,
                       windows=len(windows), text_tokens=windows.text_tokens)
    summary = report.summary(result)
    table = Table(title=f"loom eval: {model}, {file.name}, context {windows.context}, stride {windows.stride}")
    table.add_column("")
    table.add_column(source.label, justify="right")
    for name, value in report.table_rows(summary):
        table.add_row(name, value)
    out.print(table)
    _write_output(json_path, "--json", lambda: json_path.write_text(json.dumps(summary, indent=1)))
    _write_output(plot, "--plot", lambda: report.plot_kld(result, plot))


def _write_output(path: Path | None, flag: str, write) -> None:
    """Writes an output file at the end of a run; a failure the checks before could not see
    (a full disk, /proc) is one line, the figures already printed."""
    if path is None:
        return
    try:
        write()
    except (OSError, ValueError) as e:
        raise LoomError(f"{flag} {path}: cannot write it: {getattr(e, 'strerror', None) or e}") from None


def _evaluate(ev, windows, source, reference, save_base: Path | None, context: int):
    """Every window scored under a progress bar; with --save-base the run kept as a reference
    (removed again if the run fails or is interrupted: a base already there stays as it was)."""
    from rich.progress import Progress

    save = ev.sources.BaseWriter(save_base, windows, source.vocab_size, source.label) if save_base else None
    try:
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task(f"{source.label}: {len(windows)} windows of {context}", total=len(windows))
            result = ev.evaluate(windows, source, reference, save, progress=lambda k: bar.advance(task))
    except BaseException:
        if save is not None:
            save.abort()
        raise
    if save is not None:
        save.close()
    return result


def _check_eval_outputs(json_path: Path | None, plot: Path | None, has_reference: bool,
                        save_base: Path | None = None) -> None:
    """Refuses the output options that would fail only after the model loaded or the whole run."""
    if plot is not None and not has_reference:
        raise LoomError("--plot: a KLD histogram needs --kld or --base")
    for path, flag in ((json_path, "--json"), (plot, "--plot")):
        if path is not None:
            _check_writable(path, flag)
    if plot is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if plot.suffix.lstrip(".").lower() not in kinds:
            raise LoomError(f"--plot {plot}: an image file is written there; its name must end in one of "
                            f"{', '.join('.' + k for k in sorted(kinds))}")
    if save_base is not None:
        if save_base.exists() and not save_base.is_dir():
            raise LoomError(f"--save-base {save_base}: is a file; a base run is saved as a directory")
        parent = save_base.absolute().parent
        if not parent.is_dir():
            raise LoomError(f"--save-base {save_base}: no such directory {parent}")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise LoomError(f"--save-base {save_base}: permission denied")


def _check_writable(path: Path, flag: str) -> None:
    """A file the command can create or overwrite at `path`, checked without creating it."""
    where = f"{flag} {path}"
    if path.is_dir():
        raise LoomError(f"{where}: is a directory, not a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise LoomError(f"{where}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise LoomError(f"{where}: permission denied")


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LoomError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise LoomError(f"cannot read {path}: {e}") from None
    if not text.strip():
        raise LoomError(f"{path} is empty")
    return text


def main() -> None:
    """Entry point of the ``loom`` script (Ctrl-C: see _LoomGroup)."""
    app(prog_name="loom")


if __name__ == "__main__":
    main()
