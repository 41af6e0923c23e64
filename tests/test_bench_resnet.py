"""The ResNet-50 benchmark (jaxdist.bench.resnet) and `jaxdist bench resnet`."""

import json

import pytest

from jaxdist.bench import resnet as resnet_bench
from jaxdist.cli import main


@pytest.mark.slow  # three ResNet-50 compiles: about a minute on 2 cores
def test_resnet_bench_runs_end_to_end(tmp_path, capsys):
    """``bench resnet`` times jaxdist's step, the same step with 1x1 convolutions as nn.Conv,
    and the flax example's step, and rates the input pipeline."""
    out_json = tmp_path / "resnet.json"
    argv = [
        "bench",
        "resnet",
        "--batch",
        "8",
        "--image-size",
        "16",
        "--width",
        "2",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert f"{resnet_bench.JAXDIST} / flax example:" in table, table
    assert f"{resnet_bench.JAXDIST_CONV_1X1} / flax example:" in table, table
    result = json.loads(out_json.read_text())
    names = [step["name"] for step in result["steps"]]
    assert names == [resnet_bench.JAXDIST, resnet_bench.JAXDIST_CONV_1X1, resnet_bench.FLAX_EXAMPLE]
    for step in result["steps"]:
        assert step["images_per_s"] > 0 and step["compile_s"] > 0, step
    assert result["pipeline_images_per_s"] > 0 and result["devices"] == 8
