"""Long prompts for the input-length axis (`prompt_tokens`), all from text this machine has: the
Python standard library's source (long code) and its language reference (pydoc_data.topics: long
documents, retrieved passages, and the earlier turns of a long conversation).

A workload that can reach long lengths builds each prompt as head + context + tail, the context as
long as the machine allows; `fit_prompt` then cuts the context to the longest prefix for which the
whole prompt is at most `prompt_tokens` of the target's own tokens (a binary search over its
characters with the engine's tokenizer), so lengths mean the same on every engine. A workload
without long context, or a length its context cannot reach, is refused with what can."""
from __future__ import annotations

import inspect
import random
import sysconfig
from dataclasses import replace
from pathlib import Path

from .sources import CHAT_QUESTIONS, EDIT_INSTRUCTIONS, Prompt, WorkloadError, _choose, _clip, _pydoc_topics, _stdlib_functions

# Characters a token takes at most, for deciding before any model loads whether a workload's
# context can reach a length: a length needing more characters than the context holds at this
# ratio is refused at once; one it may reach is settled by the tokenizer (fit_prompt).
CHARS_PER_TOKEN_MIN = 1.0


def _stdlib_sources() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        try:
            out.append((path.name, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def _files(first: str, sources: list[tuple[str, str]], seed: int, limit: int) -> str:
    """Source files as one text, `first` (a module's file name) first, then others in a seeded
    order, until `limit` characters."""
    rng = random.Random(seed)
    rest = [s for s in sources if s[0] != first]
    rng.shuffle(rest)
    parts, n = [], 0
    for name, text in [s for s in sources if s[0] == first] + rest:
        parts.append(f"# File: {name}\n{text}\n")
        n += len(parts[-1])
        if n >= limit:
            break
    return "".join(parts)


def long_code_edit(num_prompts, seed, chars, min_lines, max_lines):
    """code_edit with its function's whole module and more standard-library modules before it:
    the model reads a long file, then edits one function of it."""
    funcs = _choose(_stdlib_functions(min_lines, max_lines), num_prompts, seed, "code_edit stdlib functions")
    sources = _stdlib_sources()
    rng = random.Random(seed + 1)
    out = []
    for i, (name, code) in enumerate(funcs):
        instr = rng.choice(EDIT_INSTRUCTIONS)
        tail = f"\n# Original code:\n{code}\n\n# Instruction: {instr}\n# Edited code:\n{code.splitlines()[0]}\n"
        context = _files(name.split(".")[0] + ".py", sources, seed + i, chars)
        out.append(Prompt(f"code_edit-{i}-{name}", tail, "code_edit", context=context, tail=tail))
    return out


def _topics_text(first: str, topics: dict[str, str], seed: int, limit: int, numbered_from: int | None = None) -> str:
    rng = random.Random(seed)
    names = [n for n in sorted(topics) if n != first]
    rng.shuffle(names)
    parts, n = [], 0
    for j, name in enumerate(([first] if numbered_from is None else []) + names):
        parts.append(f"[{numbered_from + j}] {topics[name]}\n\n" if numbered_from is not None else f"{topics[name]}\n\n")
        n += len(parts[-1])
        if n >= limit:
            break
    return "".join(parts)


def long_summarization(num_prompts, seed, chars):
    """summarization of a long document: its language-reference section, then more sections."""
    topics = _pydoc_topics()
    chosen = _choose(sorted(topics), num_prompts, seed, "summarization pydoc topics")
    tail = "\nSummary of the text above in three sentences:\n"
    return [Prompt(f"summarization-{i}-{t}", "Text:\n" + tail, "summarization", head="Text:\n",
                   context=_topics_text(t, topics, seed + i, chars), tail=tail) for i, t in enumerate(chosen)]


def long_rag(num_prompts, seed, chars, max_chars):
    """rag with many retrieved passages: the question is about passage [1], which comes first (cut
    to max_chars, as rag's passages are); the others are the long context."""
    topics = _pydoc_topics()
    chosen = _choose(sorted(topics), num_prompts, seed, "rag pydoc topics")
    out = []
    for i, t in enumerate(chosen):
        head = f"Passages:\n[1] {_clip(topics[t], max_chars)}\n\n"
        tail = (f"Question: According to passage [1], what does the documentation say about '{t}'?\n"
                "Answer, quoting the passages:")
        others = {k: v for k, v in topics.items() if k != t}
        out.append(Prompt(f"rag-{i}-{t}", head + tail, "rag", head=head,
                          context=_topics_text("", others, seed + i, chars, numbered_from=2), tail=tail))
    return out


def long_chat(num_prompts, seed, chars):
    """chat as a long conversation: earlier turns before the question asked, each a question
    about a section of the language reference answered by that section's text (the only
    answers this machine holds without a model to write them), in chat's own template."""
    topics = _pydoc_topics()
    qs = _choose(CHAT_QUESTIONS, num_prompts, seed, "chat questions")
    out, by_name = [], sorted(topics)
    for i, q in enumerate(qs):
        names = list(by_name)
        random.Random(seed + i).shuffle(names)
        turns, n = [], 0
        for name in names:
            turns.append(f"Question: What does the Python documentation say about '{name}'?\n"
                         f"Answer: {topics[name].strip()}\n\n")
            n += len(turns[-1])
            if n >= chars:
                break
        tail = f"\n\nQuestion: {q}\nAnswer:"  # apart from a last turn the cut may end inside
        out.append(Prompt(f"chat-{i}", tail, "chat", context="".join(turns), tail=tail))
    return out


LONG_CONTEXT = {"code_edit": long_code_edit, "summarization": long_summarization, "rag": long_rag, "chat": long_chat}
SOURCES = {"code_edit": "the Python standard library's source files, the edited function's module first",
           "summarization": "the Python language reference (pydoc_data.topics), concatenated",
           "rag": "the Python language reference's sections as numbered passages",
           "chat": "earlier turns of the conversation: questions on the Python language reference's sections, "
                   "answered by their text"}


def long_prompts(name: str, num_prompts: int, seed: int, prompt_tokens: int, **params) -> list[Prompt]:
    """The workload's prompts with enough context to reach prompt_tokens; refused (WorkloadError)
    for a workload without long context, or a length its context cannot reach."""
    if name not in LONG_CONTEXT:
        raise WorkloadError(f"prompt_tokens={prompt_tokens}: workload {name} has no long context to reach it; "
                            f"workloads with one: " + "; ".join(f"{w} ({src})" for w, src in SOURCES.items())
                            + "; or leave prompt_tokens unset (null) for the workload's own lengths")
    want = int(prompt_tokens * 8)  # characters to gather: more than any tokenizer needs for that many tokens
    # the workload's settings that still apply to a long prompt (a section's max_chars does not: the
    # whole document is the context)
    wanted = inspect.signature(LONG_CONTEXT[name]).parameters
    prompts = LONG_CONTEXT[name](num_prompts, seed, want, **{k: v for k, v in params.items() if k in wanted})
    short = min(len(p.head) + len(p.context) + len(p.tail) for p in prompts)
    if short < prompt_tokens * CHARS_PER_TOKEN_MIN:
        raise WorkloadError(f"prompt_tokens={prompt_tokens}: workload {name} holds at most {short} characters of "
                            f"prompt ({SOURCES[name]}), fewer than {prompt_tokens} tokens; use a smaller prompt_tokens")
    return prompts


def fit_prompt(p: Prompt, prompt_tokens: int, tokenize) -> tuple[Prompt, list[int]]:
    """The prompt with its context cut to the longest prefix that keeps the whole within
    prompt_tokens tokens (`tokenize`: the engine's text -> token ids), and its token ids. A
    WorkloadError if the prompt without context is already longer, or the whole context still
    falls short of the target by more than 1%."""
    bare = tokenize(p.head + p.tail)
    if len(bare) > prompt_tokens:
        raise WorkloadError(f"prompt_tokens={prompt_tokens}: prompt {p.id} is {len(bare)} tokens before any context; "
                            "use a larger prompt_tokens")
    lo, hi = 0, len(p.context)
    best = bare
    while lo < hi:  # the longest context prefix (in characters) whose prompt fits
        mid = (lo + hi + 1) // 2
        ids = tokenize(p.head + p.context[:mid] + p.tail)
        if len(ids) <= prompt_tokens:
            lo, best = mid, ids
        else:
            hi = mid - 1
    if len(best) < 0.99 * prompt_tokens:
        raise WorkloadError(f"prompt_tokens={prompt_tokens}: prompt {p.id} reaches only {len(best)} tokens with all "
                            "the context its workload has; use a smaller prompt_tokens")
    return replace(p, text=p.head + p.context[:lo] + p.tail, context=p.context[:lo]), best
