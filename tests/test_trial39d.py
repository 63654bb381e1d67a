"""Session 39's new user's trial (a helper on a clean clone, no GPU): what it found, mended."""
import pytest

from ex_engine import FactorError
from ex_engine.moe_layer import load_models


def test_a_missing_model_list_is_called_missing_not_malformed(tmp_path):
    """A model list that is not there read 'malformed or unreadable (FileNotFoundError ...)':
    the file is missing, and the message now says so; a file that cannot be read is
    'unreadable', and one that is not YAML still 'malformed'."""
    with pytest.raises(FactorError, match=r"model list .*nowhere\.yaml: missing \(FileNotFoundError"):
        load_models(tmp_path / "nowhere.yaml")
    with pytest.raises(FactorError, match=r"model list .*: unreadable \(IsADirectoryError"):
        load_models(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(FactorError, match=r"model list .*bad\.yaml: malformed \("):
        load_models(bad)
