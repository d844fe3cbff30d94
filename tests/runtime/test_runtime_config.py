from pathlib import Path

import pytest

from luftpause.runtime.config import RuntimeSettings, ToolsFileError, load_tools_file, parse_settings


def test_defaults_without_environment() -> None:
    settings = parse_settings([], environ={})
    assert settings == RuntimeSettings()
    assert settings.port == 7000 and settings.dataplane_url == "http://127.0.0.1:8080"
    assert settings.tools_file == Path("config/tools.yaml") and settings.state_dir == Path("state")
    assert settings.token is None and settings.default_model is None


def test_environment_sets_defaults_and_flags_win() -> None:
    environ = {
        "LUFTPAUSE_RUNTIME_HOST": "0.0.0.0",
        "LUFTPAUSE_RUNTIME_PORT": "7100",
        "LUFTPAUSE_DATAPLANE_URL": "http://dp:8080/v1/",
        "LUFTPAUSE_TOOLS_FILE": "/etc/tools.yaml",
        "LUFTPAUSE_STATE_DIR": "/var/lib/luftpause",
        "LUFTPAUSE_TOKEN": "secret",
        "LUFTPAUSE_DEFAULT_MODEL": "llama",
    }
    settings = parse_settings(["--port", "7200"], environ=environ)
    assert settings.host == "0.0.0.0" and settings.port == 7200
    assert settings.dataplane_url == "http://dp:8080"  # the OpenAI-style "/v1" base is accepted
    assert settings.tools_file == Path("/etc/tools.yaml")
    assert settings.state_dir == Path("/var/lib/luftpause")
    assert settings.token == "secret" and settings.default_model == "llama"


def test_help_names_every_environment_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--help"], environ={})
    text = capsys.readouterr().out
    for variable in ("LUFTPAUSE_RUNTIME_HOST", "LUFTPAUSE_RUNTIME_PORT", "LUFTPAUSE_DATAPLANE_URL",
                     "LUFTPAUSE_TOOLS_FILE", "LUFTPAUSE_STATE_DIR", "LUFTPAUSE_TOKEN", "LUFTPAUSE_DEFAULT_MODEL"):
        assert variable in text


def test_missing_tools_file_means_none(tmp_path: Path) -> None:
    assert load_tools_file(tmp_path / "absent.yaml") is None


def test_tools_file_with_http_and_stdio_servers(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(
        """
servers:
  - name: fake
    url: http://127.0.0.1:9000/mcp
    headers: {Authorization: Bearer x}
  - name: wiki
    command: wikipedia-mcp
    args: [--transport, stdio]
    env: {WIKI_LANG: en}
"""
    )
    fake, wiki = load_tools_file(path) or []
    assert fake.transport == "http" and fake.url == "http://127.0.0.1:9000/mcp"
    assert fake.headers == {"Authorization": "Bearer x"}
    assert wiki.transport == "stdio" and wiki.command == "wikipedia-mcp"
    assert list(wiki.args) == ["--transport", "stdio"] and wiki.env == {"WIKI_LANG": "en"}


@pytest.mark.parametrize(
    "document",
    [
        "servers: {name: x}",
        "servers:\n  - url: http://x/mcp",
        "servers:\n  - name: x\n    url: http://x/mcp\n    command: y",
        "servers:\n  - name: x",
        "servers:\n  - name: x\n    url: http://a/mcp\n  - name: x\n    url: http://b/mcp",
        "servers:\n  - name: x\n    command: y\n    args: notalist",
    ],
)
def test_invalid_tools_files_are_rejected(tmp_path: Path, document: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(document)
    with pytest.raises(ToolsFileError):
        load_tools_file(path)


def test_empty_tools_file_means_no_servers(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text("")
    assert load_tools_file(path) == []
