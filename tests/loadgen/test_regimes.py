"""The regime map: its cells around the frozen preset, each cell's comparison with the best
peer row, and the table and heatmap drawn from a map's JSON. The fixtures come from a real
(tiny, shared-machine) run of one cell: ``regimes --cell eager=0 --window-s 20 --warmup-s 10``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from luftpause.fakes.engine import PRESETS
from luftpause.loadgen import regimes
from luftpause.loadgen.bench import BenchConfig

FIXTURES = Path(__file__).parent / "fixtures"
PRESET = PRESETS["laptop-1b-sglang"]


def test_the_grid_is_each_axis_around_the_preset_plus_the_eager_kv_corners_and_the_layouts() -> None:
    cells = {c.name: c for c in regimes.cell_grid()}
    assert list(cells) == ["preset", "eager=0", "eager=10", "eager=40", "kv=-30", "kv=+30", "prefill=-30",
                           "prefill=+30", "eager=0,kv=-30", "eager=0,kv=+30", "eager=40,kv=-30", "eager=40,kv=+30",
                           "gpus=separate", "replicas=3"]
    assert cells["preset"].engine_overrides(PRESET) == ()
    assert regimes.parse_cell("eager=20").engine_overrides(PRESET) == ()  # the preset's own eager step
    assert cells["eager=0"].engine_overrides(PRESET) == (("decode_eager_ms", 0.0),)
    assert cells["kv=-30"].engine_overrides(PRESET) == (("kv_tokens", 25200.0),)
    assert cells["prefill=+30"].engine_overrides(PRESET) == (("prefill_ms_per_token", pytest.approx(0.0455)),)
    assert cells["eager=40,kv=+30"].engine_overrides(PRESET) == (("decode_eager_ms", 40.0), ("kv_tokens", 46800.0))
    assert (cells["gpus=separate"].replicas, cells["gpus=separate"].shared_gpu) == (2, False)
    assert (cells["replicas=3"].replicas, cells["replicas=3"].shared_gpu) == (3, False)
    assert all(c.shared_gpu and c.replicas == 2 for name, c in cells.items() if name not in ("gpus=separate",
                                                                                            "replicas=3"))


def test_a_cell_runs_the_engines_with_its_options_and_the_preset_unchanged() -> None:
    config = regimes.parse_cell("eager=0,kv=-30").config(BenchConfig(repeats=1))
    args = config.engine_args()
    assert args[args.index("--decode-eager-ms") + 1] == "0.0"
    assert args[args.index("--kv-tokens") + 1] == "25200"  # an integer option stays an integer
    assert args[args.index("--preset") + 1] == "laptop-1b-sglang"
    assert config.engine_values()["kv_tokens"] == 25200 and PRESETS["laptop-1b-sglang"]["kv_tokens"] == 36000
    separate = regimes.parse_cell("replicas=3").config(BenchConfig())
    assert (separate.replicas, separate.shared_gpu) == (3, False)


@pytest.mark.parametrize("text", ["eager=-1", "kv=lots", "speed=2", "replicas=3,gpus=shared", "kv=-100"])
def test_cells_outside_the_model_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        regimes.parse_cell(text)


def test_a_cell_summary_holds_luftpause_against_the_best_peer_row_per_metric() -> None:
    b2 = json.loads((FIXTURES / "b2-eager0-tiny-comparison.json").read_text())
    summary = regimes.cell_summary(regimes.parse_cell("eager=0"), b2, None)
    proxy = b2["comparison"]["proxy"]
    assert summary["interactive"]["best_row"] == proxy["interactive_runs_per_min"]["best_row"]
    assert summary["interactive"]["ratio"] == proxy["interactive_runs_per_min"]["ratios"]["strict"]
    assert summary["batch_vs_class_blind"] == proxy["batch_vs_class_blind"]["ratios"]["strict"]
    assert summary["engine_overrides"] == {"decode_eager_ms": 0.0}
    missed = json.loads(json.dumps(b2))  # the same run, had luftpause's batch been low
    missed["comparison"]["proxy"]["batch_vs_class_blind"]["ratios"]["strict"] = 0.9
    assert regimes.cell_summary(regimes.parse_cell("eager=0"), missed, None)["misses"] == ["batch"]
    assert summary["other_rows"] == {}
    lifted = json.loads(json.dumps(b2))  # a lifted-ceiling row run beside it (--variants strict-lift)
    for metric, value in (("interactive_runs_per_min", 1.2), ("interactive_p50_s", 0.9), ("batch_runs_per_min", 1.0),
                          ("batch_vs_class_blind", 0.97)):
        lifted["comparison"]["proxy"][metric]["ratios"]["strict-lift"] = value
    other = regimes.cell_summary(regimes.parse_cell("eager=0"), lifted, None)
    assert other["other_rows"] == {"strict-lift": {"interactive": 1.2, "p50": 0.9, "batch": 1.0,
                                                   "batch_vs_class_blind": 0.97}}
    assert other["interactive"]["ratio"] == summary["interactive"]["ratio"]  # the strict row is still the cell's


def test_the_command_takes_only_known_policy_rows() -> None:
    with pytest.raises(SystemExit):
        regimes.main(["--cell", "eager=0", "--variants", "strict-lift,strict-bogus"])


def test_table_and_heatmap_from_a_maps_json(tmp_path: Path, capsys) -> None:
    fixture = FIXTURES / "regimes-eager0-tiny.json"
    result = json.loads(fixture.read_text())
    rows, values = regimes.heatmap_values(result)
    assert rows == ["eager=0"] and len(values[0]) == len(regimes.HEATMAP_COLUMNS)
    assert values[0][0] == result["cells"][0]["interactive"]["ratio"]
    regimes.print_map(result)
    assert "eager=0" in capsys.readouterr().out
    png = regimes.plot_map(fixture, tmp_path / "map.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_the_command_lists_cells_and_refuses_bad_ones(capsys) -> None:
    regimes.main(["--list"])
    assert capsys.readouterr().out.split() == [c.name for c in regimes.cell_grid()]
    regimes.main(["--list", "--cell", "eager=0,kv=+30"])
    assert capsys.readouterr().out.split() == ["eager=0,kv=+30"]
    with pytest.raises(SystemExit):
        regimes.main(["--cell", "warp=9"])
