"""_yaml.load keeps the last documents parsed, by their text (a registry built again in one
process re-read its tuning files and manifests: about 0.1 s of its 0.16 s)."""
import pytest
import yaml

from ex_engine import FactorRegistry, _yaml

DOC = "device: h200\ntable:\n  - {T: 1, config: a}\n  - &r {T: 8, config: b}\n  - *r\n"


@pytest.fixture(autouse=True)
def _empty_cache():
    _yaml._cache.clear()
    yield
    _yaml._cache.clear()


def test_each_call_gets_its_own_copy():
    first = _yaml.load(DOC)
    first["table"][0]["config"] = "changed"
    first["table"].append("extra")
    second = _yaml.load(DOC)
    assert second == {"device": "h200", "table": [{"T": 1, "config": "a"}, {"T": 8, "config": "b"},
                                                  {"T": 8, "config": "b"}]}
    assert second is not first and second["table"] is not first["table"]
    # an alias is still one object within a document, as PyYAML gives it
    assert second["table"][1] is second["table"][2]
    second["table"][1]["config"] = "changed"       # a copy served from the cache, changed
    assert _yaml.load(DOC)["table"][1] == {"T": 8, "config": "b"}


def test_the_cached_copy_is_not_the_one_returned_on_the_first_call():
    first = _yaml.load(DOC)
    first["device"] = "changed"      # the caller's copy, changed before any second call
    assert _yaml.load(DOC)["device"] == "h200"


def test_an_edited_text_is_parsed_again():
    assert _yaml.load("a: 1\n") == {"a": 1}
    assert _yaml.load("a: 2\n") == {"a": 2}
    assert _yaml.load(b"a: 3\n") == {"a": 3}


def test_a_text_that_fails_fails_each_time_naming_each_calls_file():
    bad = "a: 1\na: 2\n"
    for name in ("one.yaml", "two.yaml"):
        with pytest.raises(yaml.YAMLError, match=name):
            _yaml.load(bad, name=name)
    assert not _yaml._cache


def test_the_cache_is_bounded():
    for i in range(_yaml.CACHE_ENTRIES + 10):
        assert _yaml.load(f"k: {i}\n") == {"k": i}
    assert len(_yaml._cache) == _yaml.CACHE_ENTRIES
    assert "k: 0\n" not in _yaml._cache and f"k: {_yaml.CACHE_ENTRIES + 9}\n" in _yaml._cache


def test_a_long_text_is_not_kept(monkeypatch):
    monkeypatch.setattr(_yaml, "CACHE_MAX_LEN", 8)
    assert _yaml.load("key: value\n") == {"key": "value"}
    assert not _yaml._cache


def test_a_cached_document_is_not_parsed_again(monkeypatch):
    calls = []
    parse = _yaml._parse
    monkeypatch.setattr(_yaml, "_parse", lambda text, name: calls.append(text) or parse(text, name))
    _yaml.load(DOC)
    _yaml.load(DOC)
    assert calls == [DOC]


def test_a_registry_built_again_parses_none_of_its_files_again(monkeypatch):
    first = FactorRegistry.load(hardware="h200")
    calls = []
    parse = _yaml._parse
    monkeypatch.setattr(_yaml, "_parse", lambda text, name: calls.append(name) or parse(text, name))
    second = FactorRegistry.load(hardware="h200")
    assert calls == []
    assert [(p.name, p.status) for p in second.plugins] == [(p.name, p.status) for p in first.plugins]
