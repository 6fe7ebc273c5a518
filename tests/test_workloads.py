"""Workload loaders and their errors."""
import inspect
import json
from pathlib import Path

import pytest

from workloads import WORKLOADS, WorkloadError, WorkloadUnavailable, load_prompts


@pytest.mark.parametrize("name", ["code_edit", "code_gen", "chat", "summarization", "rag", "math"])
def test_builtin_workloads_are_deterministic_and_distinct(name):
    a = load_prompts(name, 4, seed=3)
    b = load_prompts(name, 4, seed=3)
    c = load_prompts(name, 4, seed=4)
    assert [p.text for p in a] == [p.text for p in b]
    assert len(a) == 4 and all(p.text.strip() for p in a)
    assert len({p.text for p in a}) == 4  # real mixed requests, not one prompt copied
    assert [p.text for p in a] != [p.text for p in c]
    assert len({p.id for p in a}) == 4


def test_code_edit_prompt_holds_stdlib_code_and_instruction():
    p = load_prompts("code_edit", 1, seed=0)[0]
    assert "# Original code:\ndef " in p.text and "# Instruction:" in p.text and p.text.endswith("\n")


def test_code_gen_reads_humaneval():
    p = load_prompts("code_gen", 2, seed=0)
    assert all("def " in x.text and "HumanEval/" in x.id for x in p)


def test_translation_uses_catalogs_or_skips_clearly(tmp_path):
    with pytest.raises(WorkloadUnavailable, match="gettext catalogs"):
        load_prompts("translation", 2, seed=0, locale_dir=str(tmp_path))


def test_unknown_workload_lists_valid_names():
    with pytest.raises(WorkloadError, match="valid: .*code_edit.*chat"):
        load_prompts("poetry", 2, seed=0)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_specbench_shape_and_category_filter(tmp_path):
    f = _write(tmp_path / "q.jsonl", [json.dumps({"question_id": i, "category": c, "turns": [f"question {i}?"]})
                                      for i, c in enumerate(["math", "coding", "math", "writing"])])
    got = load_prompts("jsonl", 2, seed=0, path=str(f), categories=["math"])
    assert {p.category for p in got} == {"math"} and len(got) == 2
    assert got[0].text.startswith("Question: question ")


def _speed_bench_row(i, category, sub, difficulty, text):
    """A row as SPEED-Bench's dataset card declares its fields (huggingface.co/datasets/nvidia/SPEED-Bench:
    question_id, category, sub_category, turns, source, src_id, difficulty, multiturn)."""
    return json.dumps({"question_id": f"{i:032x}", "category": category, "sub_category": sub, "turns": [text],
                       "source": "built-here", "src_id": str(i), "difficulty": difficulty, "multiturn": False})


def test_speed_bench_rows_group_by_any_of_their_fields_and_placeholders_are_refused(tmp_path):
    """SPEED-Bench as a workload format, on a file written here in its shape: the category the
    report's acceptance-by-category matrix groups by can be its sub_category or difficulty; AIPerf's
    `messages` rows read the same; the public copy's placeholder text is refused with what to do."""
    rows = [_speed_bench_row(0, "coding", "python", "easy", "Write a function that adds two numbers."),
            _speed_bench_row(1, "coding", "sql", "hard", "Write a query that counts rows."),
            _speed_bench_row(2, "math", "algebra", "easy", "Solve x + 1 = 3.")]
    f = _write(tmp_path / "speed.jsonl", rows)
    assert sorted(p.category for p in load_prompts("jsonl", 3, seed=0, path=str(f))) == ["coding", "coding", "math"]
    by_sub = load_prompts("jsonl", 3, seed=0, path=str(f), category_field="sub_category")
    assert sorted(p.category for p in by_sub) == ["algebra", "python", "sql"]
    easy = load_prompts("jsonl", 2, seed=0, path=str(f), category_field="difficulty", categories=["easy"])
    assert {p.category for p in easy} == {"easy"} and len(easy) == 2
    with pytest.raises(WorkloadError, match=r"unknown \['medium'\]; the file has difficulty values \['easy', 'hard'\]"):
        load_prompts("jsonl", 1, seed=0, path=str(f), category_field="difficulty", categories=["medium"])
    with pytest.raises(WorkloadError, match=r"category_field='level': no question .* its fields: \[.*'difficulty'"):
        load_prompts("jsonl", 1, seed=0, path=str(f), category_field="level")
    msgs = _write(tmp_path / "aiperf.jsonl", [json.dumps({"question_id": "a" * 32, "category": "qa", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]})])
    assert load_prompts("jsonl", 1, seed=0, path=str(msgs))[0].text == "Question: What is 2 + 2?\nAnswer:"
    placeholder = _write(tmp_path / "public.jsonl", [rows[0], _speed_bench_row(
        3, "rag", "news", "hard", "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH")])
    with pytest.raises(WorkloadError, match=r"public\.jsonl, line 2: question '0+3' holds SPEED-Bench's placeholder "
                                            r"text.*Rebuild the file with SPEED-Bench's own preparation script"):
        load_prompts("jsonl", 1, seed=0, path=str(placeholder))


def test_jsonl_errors_name_the_problem(tmp_path):
    with pytest.raises(WorkloadError, match="no such file"):
        load_prompts("jsonl", 1, seed=0, path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(WorkloadError, match="workload.path=FILE"):
        load_prompts("jsonl", 1, seed=0, path=None)
    bad = _write(tmp_path / "bad.jsonl", ['{"question_id": 1, "category": "a", "turns": ["x"]}', '{"question_id": 2,'])
    with pytest.raises(WorkloadError, match="line 2: not valid JSON"):
        load_prompts("jsonl", 1, seed=0, path=str(bad))
    latin1 = tmp_path / "latin1.jsonl"  # a byte that is not UTF-8 (0xff) on line 2: named, not a bare codec error
    latin1.write_bytes(b'{"question_id": 1, "turns": ["x"]}\n{"question_id": 2, "turns": ["caf\xe9 \xff"]}\n')
    with pytest.raises(WorkloadError, match=r"latin1\.jsonl, line 2: not UTF-8 \(byte 0xe9 at column 34\)"):
        load_prompts("jsonl", 1, seed=0, path=str(latin1))
    bom = _write(tmp_path / "bom.jsonl", ['\ufeff{"question_id": 1, "category": "a", "turns": ["x"]}'])
    assert load_prompts("jsonl", 1, seed=0, path=str(bom))  # a BOM before the first line (Windows editors) is fine
    shape = _write(tmp_path / "shape.jsonl", ['{"question_id": 1, "prompt": "x"}'])
    with pytest.raises(WorkloadError, match='line 1: expected an object with "turns"'):
        load_prompts("jsonl", 1, seed=0, path=str(shape))
    ok = _write(tmp_path / "ok.jsonl", ['{"question_id": 1, "category": "a", "turns": ["x"]}'])
    with pytest.raises(WorkloadError, match=r"unknown \['zz'\]; the file has categories \['a'\]"):
        load_prompts("jsonl", 1, seed=0, path=str(ok), categories=["zz"])
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(WorkloadError, match="holds no questions"):
        load_prompts("jsonl", 1, seed=0, path=str(empty))


def test_num_prompts_must_be_positive():
    with pytest.raises(WorkloadError, match="num_prompts=0"):
        load_prompts("chat", 0, seed=0)


def test_every_workload_has_a_typed_node_whose_defaults_its_prompts_use():
    import dataclasses

    from hydra import compose, initialize_config_dir

    from bench.cli import CONF_DIR  # importing the CLI registers the typed nodes (run alone, nothing else has)
    from workloads import WORKLOAD_SETTINGS
    from workloads.sources import resolved_settings

    assert set(WORKLOAD_SETTINGS) == set(WORKLOADS)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for name, node in WORKLOAD_SETTINGS.items():
            cfg = compose("config", overrides=[f"workload={name}"])
            assert [k for k in cfg.workload] == [f.name for f in dataclasses.fields(node)]
        with pytest.raises(Exception, match="max_lines"):  # a setting's type is the node's
            compose("config", overrides=["workload=code_edit", "workload.max_lines=many"])
    # the function is given the node's defaults (written nowhere else), overridden by the job's
    assert resolved_settings("code_edit", {}) == {"min_lines": 8, "max_lines": 30}
    assert resolved_settings("code_edit", {"max_lines": 12, "passages": 3}) == {"min_lines": 8, "max_lines": 12}
    for name, fn in WORKLOADS.items():  # no default of the function's own, no catch-all **kwargs
        params = list(inspect.signature(fn).parameters.values())[2:]
        assert all(p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in params), name
        assert [p.name for p in params] == [f.name for f in dataclasses.fields(WORKLOAD_SETTINGS[name])][1:], name


def test_mixed_takes_its_parts_in_turn_each_prompt_labelled_with_its_workload():
    ps = load_prompts("mixed", 5, 0)
    assert [p.category for p in ps] == ["code_edit", "chat", "code_edit", "chat", "code_edit"]
    # each part's prompts are the part's own (same seed), in its own order
    assert [p.text for p in ps[0::2]] == [p.text for p in load_prompts("code_edit", 3, 0)]
    assert [p.text for p in ps[1::2]] == [p.text for p in load_prompts("chat", 3, 0)[:2]]
    assert len({p.id for p in ps}) == 5
    three = load_prompts("mixed", 3, 1, parts=["math", "chat", "summarization"])
    assert [p.category for p in three] == ["math", "chat", "summarization"]
    for bad in (["poetry"], [], ["mixed"]):
        with pytest.raises(WorkloadError, match=r"workload.parts=.* is not valid; name one or more of code_edit"):
            load_prompts("mixed", 2, 0, parts=bad)
