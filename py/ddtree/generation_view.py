"""What `ddtree-run generate` shows: per-stream progress bars with live tokens/s, or the text of a text prompt
streamed as rounds commit, then each stream's result as lines or as one JSON document."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from ddtree.results import GenerationResult
from ddtree.tokenizer import TextStream, Tokenizer

# A mean acceptance length below this means the drafter predicts almost none of the target's tokens.
NEAR_ONE_ACCEPTANCE = 1.25

OnTokens = Callable[[int, list[int]], None]  # (stream, tokens emitted so far)


@dataclass(frozen=True, slots=True)
class Run:
    """What one generate command ran: the backend, the method and each stream's prompt."""

    backend: str
    method: str
    prompt_ids: Sequence[Sequence[int]]
    prompt_texts: Sequence[str] | None  # None for --prompt-ids
    max_new_tokens: int


class _TokensPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        return Text(f"{task.completed / elapsed:.1f} tokens/s" if elapsed > 0 and task.completed else "")


@contextmanager
def progress_display(run: Run, console: Console, tokenizer: Tokenizer | None, quiet: bool) -> Iterator[OnTokens]:
    """The callback to hand each stream's tokens to while generating: nothing is shown when `quiet` (--json),
    the text as it grows for a text prompt (streams run one after another on the reference backend), progress
    bars on a terminal otherwise (transient: the results are printed after; a pipe gets the results only)."""
    if tokenizer is not None and run.prompt_texts is not None and not quiet:
        yield _stream_text(run, console, tokenizer)
        console.out("")
    elif quiet or not console.is_terminal:
        yield lambda stream, tokens: None
    else:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), _TokensPerSecond(),
                            TimeElapsedColumn(), console=console, transient=True)
        with progress:
            # A stream's clock starts with its first token, so tokens/s is its decode rate, not time spent queued.
            tasks = [progress.add_task(f"[bold]{run.backend}[/bold] {run.method} stream {i}",
                                       total=run.max_new_tokens, start=False) for i in range(len(run.prompt_ids))]

            def update(stream: int, tokens: list[int]) -> None:
                progress.start_task(tasks[stream])
                progress.update(tasks[stream], completed=len(tokens))

            yield update


def _stream_text(run: Run, console: Console, tokenizer: Tokenizer) -> OnTokens:
    texts = run.prompt_texts or ()
    streams = [TextStream(tokenizer) for _ in texts]
    current = [-1]

    def show(stream: int, tokens: list[int]) -> None:
        if stream != current[0]:
            if current[0] >= 0:
                console.out("")
            console.out(f"[{stream}] {texts[stream]}", end="", highlight=False)
            current[0] = stream
        console.out(streams[stream].update(tokens), end="", highlight=False)

    return show


def show_results(run: Run, results: Sequence[GenerationResult], console: Console, as_json: bool) -> None:
    if as_json:
        console.out(json.dumps(_json(run, results)), highlight=False)
        return
    for i, result in enumerate(results):
        if result.text is None:
            console.out(f"[{i}] prompt {list(run.prompt_ids[i])} -> {result.tokens}", highlight=False)
        # a text prompt's stream was printed as text: the line names the stream it belongs to
        line = (f"{'    ' if result.text is None else f'[{i}] '}{len(result.tokens)} tokens, prefill {result.prefill_seconds * 1e3:.1f} ms, "
                f"decode {result.tokens_per_second:.1f} tokens/s ({run.backend}, {run.method})")
        if result.accept_lengths:
            line += (f", {len(result.accept_lengths)} rounds, mean acceptance length {_mean_acceptance(result):.2f}; "
                     f"acceptance length per round: {' '.join(map(str, result.accept_lengths))}")
            if len(set(result.budgets)) > 1:  # budget "auto" chose among several
                line += f"; budget per round: {' '.join(map(str, result.budgets))}"
        console.out(line, highlight=False)
    if results and results[0].stage_seconds:
        stages = results[0].stage_seconds
        total = sum(stages.values())
        split = ", ".join(f"{name} {sec * 1e3:.2f} ms ({sec / total:.0%})" for name, sec in stages.items())
        console.out(f"round stages (device time over all rounds, eager): {split}", highlight=False)
    lengths = [length for result in results for length in result.accept_lengths]
    if lengths and sum(lengths) / len(lengths) < NEAR_ONE_ACCEPTANCE:
        console.out(f"note: a mean acceptance length near 1 ({sum(lengths) / len(lengths):.2f}) means the drafter "
                      f"predicts almost none of the target's tokens (as with random weights): each DDTree round then "
                      f"pays a draft and a verify of the whole tree for about one token, so it runs slower than "
                      f"autoregressive decoding", highlight=False)


def _mean_acceptance(result: GenerationResult) -> float:
    return sum(result.accept_lengths) / len(result.accept_lengths)


def _json(run: Run, results: Sequence[GenerationResult]) -> dict[str, object]:
    streams = []
    for i, result in enumerate(results):
        stream: dict[str, object] = {"prompt_ids": list(map(int, run.prompt_ids[i])), "tokens": result.tokens,
                                     "prefill_seconds": result.prefill_seconds,
                                     "decode_seconds": result.decode_seconds,
                                     "tokens_per_second": result.tokens_per_second,
                                     "accept_lengths": result.accept_lengths}
        if result.budgets:
            stream["budgets"] = result.budgets
        if run.prompt_texts is not None:
            stream.update(prompt=run.prompt_texts[i], text=result.text)
        streams.append(stream)
    out: dict[str, object] = {"backend": run.backend, "method": run.method, "streams": streams}
    if results and results[0].stage_seconds:
        out["stage_seconds"] = results[0].stage_seconds
    return out
