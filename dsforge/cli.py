"""The `dsforge` command: thin click commands that load, call one function and print."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from dsforge.bench.command import bench_main, report_main
from dsforge.hardware import GPU_KEYS
from dsforge.launch.checks import check_hosts
from dsforge.launch.entry import RunOptions, deepspeed_argv, launch, launched_rank_job
from dsforge.launch.refusal import BadOptions, Refused, resolve_or_refuse, warn
from dsforge.launch.run_options import run_options
from dsforge.launch.sbatch import sbatch_options, write_batch_script
from dsforge.problems import EXIT_INVALID
from dsforge.search.options import search_options


def _recipe_options(command):
    """RECIPE plus the world (--world-size | --hostfile) and --set overrides."""
    command = click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
                           help="Override a recipe field, typed like YAML. Repeatable.")(command)
    command = click.option("--hostfile", type=click.Path(dir_okay=False),
                           help="DeepSpeed hostfile; the world size is its total slots.")(command)
    command = click.option("--world-size", type=click.IntRange(min=1),
                           help="Number of GPUs (ranks) to plan for.")(command)
    return click.argument("recipe", type=click.Path(dir_okay=False))(command)


def _or_exit(command, *args, **kwargs):
    """What `command` returns; its refusals printed (exit 2), bad options too, as click's
    errors are but without the usage lines (most name a run directory or a checkpoint, not
    the command line's grammar)."""
    try:
        return command(*args, **kwargs)
    except Refused as refused:
        refused.report()
        sys.exit(EXIT_INVALID)
    except BadOptions as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(EXIT_INVALID)


_say = functools.partial(click.echo, err=True)  # one of dsforge's own lines, on stderr
_show = functools.partial(click.echo, nl=False)  # text for stdout, as it is


def entry(argv: list[str] | None = None) -> None:
    """Console entry point, also for the ranks DeepSpeed's launcher starts as `-m dsforge`."""
    main(args=deepspeed_argv(sys.argv[1:] if argv is None else argv), prog_name="dsforge")


@click.group()
@click.version_option(package_name="dsforge")
def main() -> None:
    """dsforge: one YAML recipe -> a DeepSpeed ZeRO + Megatron-Core training job."""


@main.command()
@_recipe_options
def validate(recipe, world_size, hostfile, overrides):
    """Check RECIPE against every rule; exit 0 if valid, 2 with all problems otherwise."""
    resolved = _or_exit(resolve_or_refuse, recipe, overrides, world_size, hostfile)
    warn(resolved.warnings, _say)
    lay = resolved.layout
    cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
    click.echo(f"{recipe}: valid for world size {lay.world_size} (dp {lay.dp} x tp {lay.tp} x "
               f"pp {lay.pp}{cp}, grad_accum {lay.grad_accum})")


_SEARCH_ONLY = ("gpus", "gpus_per_node", "gpu", "global_batch_tokens", "seq_len", "write", "html",
                "profile", "measure", "measure_out", "memory_headroom")


@main.command()
@_recipe_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@search_options
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True,
              help="Translate the engine configs for this device; auto = cuda when a GPU is "
                   "visible here, else cpu (what `dsforge run` would use).")
def plan(recipe, world_size, hostfile, overrides, as_json, search, top, device, **search_options):
    """Show how RECIPE will be laid out, its configs, memory, bubble and FLOPs.

    With --search, RECIPE may be a model preset name (e.g. llama3-70b): every valid layout
    is estimated and the fastest that fit are ranked, with the reasons.
    """
    if search:
        if world_size or hostfile or device != "auto":
            raise click.UsageError("with --search, give the cluster as --gpus N [--gpus-per-node G] "
                                   "(the search plans for GPUs; --device does not apply)")
        from dsforge.search.command import run_search_command
        return run_search_command(recipe, overrides=overrides, as_json=as_json, top=top,
                                  **search_options)
    given = [f"--{name.replace('_', '-')}" for name in _SEARCH_ONLY if search_options.get(name)]
    if given:
        raise click.UsageError(f"{', '.join(given)} only apply with --search")
    from dsforge.plan import build_plan, render_plan
    result = build_plan(_or_exit(resolve_or_refuse, recipe, overrides, world_size, hostfile),
                        device=device)
    click.echo(json.dumps(result, indent=2) if as_json else render_plan(result))


@main.command()
@_recipe_options
@run_options
def run(**options):
    """Train RECIPE: validate, check that it fits this machine, then start the ranks with
    DeepSpeed's launcher, here or on the hosts of --hostfile. Also runs as the script
    `deepspeed ... -m dsforge run` starts."""
    options = _or_exit(RunOptions.gather, **options)
    if options.local_rank is not None:  # started by DeepSpeed's launcher: be a rank
        from dsforge.runtime.rank import run_rank
        run_rank(_or_exit(launched_rank_job, options))
    sys.exit(_or_exit(launch, options, say=_say, show=_show))


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@sbatch_options
def sbatch(recipe, **options):
    """Write a Slurm batch script for RECIPE: #SBATCH lines, a trap that passes Slurm's
    warning signal to `dsforge run --launcher slurm`, and a requeue when the ranks stopped
    with a checkpoint (exit 75); the requeued job resumes. Exit status: 0 written, 2 refused."""
    _or_exit(write_batch_script, recipe, say=_say, show=_show, **options)


@main.command()
@_recipe_options
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True)
@click.option("--include", default="", help="DeepSpeed --include filter.")
@click.option("--exclude", default="", help="DeepSpeed --exclude filter.")
@click.option("--ssh-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True)
def preflight(recipe, **options):
    """Check RECIPE and the hosts of --hostfile before a multi-node run: hostfile, world size,
    SSH to every host (in parallel), the master port, the same package versions everywhere,
    and that the job fits each host and can build there what its ranks build."""
    _or_exit(check_hosts, recipe, say=_say, **options)


@main.group()
def data() -> None:
    """Prepare and inspect corpora for training (docs/data.md)."""


@data.command("prepare")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--tokenizer", required=True, metavar="T",
              help="A local tokenizer.json, a local Hugging Face model folder, or 'bytes' "
                   "(UTF-8 bytes, EOD 256). Nothing is downloaded.")
@click.option("--output", required=True, metavar="PREFIX",
              help="Writes PREFIX.bin, PREFIX.idx and PREFIX.tokenizer.json.")
@click.option("--text-key", default="text", show_default=True,
              help="The field of each JSON-lines record that holds the document.")
@click.option("--workers", type=click.IntRange(min=0), default=1, show_default=True,
              help="Tokenizing processes (0: this process). The output does not depend on it.")
@click.option("--eod-token", default=None,
              help="End-of-document token [default: the tokenizer's eos_token].")
@click.option("--overwrite", is_flag=True, help="Replace an existing PREFIX.bin/.idx.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr [default: when stderr is a terminal].")
def data_prepare(inputs, **options):
    """Tokenize INPUT... (JSON-lines or plain text files, folders or globs of them) into a
    Megatron indexed dataset PREFIX.bin/.idx, the format Megatron-LM's and GPT-NeoX's tools
    read and write. Exit status: 0 written, 2 bad input (nothing written), 130/143 stopped."""
    from dsforge.data.prepare import prepare_main
    sys.exit(prepare_main(inputs, **options))


@data.command("inspect")
@click.argument("prefix", metavar="PREFIX")
@click.option("--scan", is_flag=True,
              help="Read every token (memory-mapped, in chunks) and print the largest id.")
def data_inspect(prefix, scan):
    """Show a Megatron indexed dataset PREFIX.bin/.idx: documents, sequences, tokens, dtype and
    the tokenizer recorded beside it. Reads the index only, unless --scan. Exit status: 0, or 2
    for a prefix that cannot be opened."""
    from dsforge.data.indexed import inspect_main
    sys.exit(inspect_main(prefix, scan=scan))


@main.command()
@click.argument("study", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Results directory [default: benchmarks/STUDY-NAME].")
@click.option("--retry-failed", is_flag=True, help="Run oom/timeout/crashed cells again.")
@click.option("--tiny", is_flag=True, help="Every cell's layout at tiny size on CPU ranks (a "
              "dry run of the study); recorded as study NAME-tiny.")
@click.option("--skip-fit-check", is_flag=True,
              help="Run every valid cell, even one whose ranks or memory do not fit this machine "
                   "(rejected by default, as dsforge run refuses it).")
@click.option("--db-timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Wait this long for a lock on results.db [default: as long as cells may run].")
def bench(study, **options):
    """Run every cell of STUDY (a sweep over recipe fields) into OUT/results.db, skipping finished
    cells. Exit status: 0 every cell has a result, 2 invalid study or unusable OUT, 75 cells busy
    or the database locked (run again later), 130/143 stopped by Ctrl-C/SIGTERM (docs/bench.md)."""
    sys.exit(_or_exit(bench_main, study, **options))


@main.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Where report.md and the plots go [default: next to RESULTS].")
@click.option("--peak-tflops", type=float, default=None,
              help="Peak dense TFLOP/s per GPU for MFU, instead of the device table's.")
def report(results, out, peak_tflops):
    """Write a markdown report with PNG plots from a bench results database."""
    sys.exit(report_main(results, out, peak_tflops=peak_tflops))


@main.command()
@_recipe_options
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The profile to write (a --profile file for dsforge plan --search).")
@click.option("--gpu", type=click.Choice(GPU_KEYS),
              help="The GPU the profile plans for [the visible one; else the recipe's, else h100].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Where to measure; auto = cuda when a GPU is visible.")
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True)
def calibrate(recipe, world_size, hostfile, overrides, **options):
    """Measure RECIPE's GEMMs, optimizer step, attention and memory bandwidth on this machine
    and write them as a cluster profile (docs/search.md "Calibration")."""
    from dsforge.calibrate.command import calibrate_main
    calibrate_main(_or_exit(resolve_or_refuse, recipe, overrides, world_size, hostfile), **options)


@main.command()
@click.argument("results", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The refitted profile to write (a --profile file for dsforge plan --search).")
@click.option("--profile", type=click.Path(dir_okay=False, path_type=Path),
              help="The profile to refit [the default of the GPU the cells ran on].")
@click.option("--study", help="Only this study's cells [every study in RESULTS].")
def refit(results, **options):
    """Refit the planner's profile from the finished cells of bench studies (RESULTS.db) and
    write it (docs/search.md). Exit status: 0 written, 2 refused (nothing written)."""
    from dsforge.calibrate.refit import refit_main
    sys.exit(refit_main(results, **options))


@main.command()
@click.argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT",
                type=click.Path(file_okay=False, path_type=Path))
@click.option("--to", "out", required=True, type=click.Path(path_type=Path),
              help="The Hugging Face folder to write; must not exist or be empty.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Weight dtype [default: the training precision's].")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors shard, e.g. 5GB, 500MB, 2GiB.")
def export(checkpoint, out, dtype, max_shard_size):
    """Write a checkpoint as a Hugging Face model folder: Llama for dense models, Mixtral for
    models whose every layer is MoE (docs/export.md). RUN_DIR means its latest complete
    checkpoint. Exit status: 0 written, 2 refused (nothing written)."""
    from dsforge.hf.export import export_main
    sys.exit(export_main(checkpoint, out, dtype=dtype, max_shard_size=max_shard_size))
