"""MNIST-5k through a 4-stage pipeline on 2 data-parallel replicas: the small-batch recipe's
model, data, batch and schedule, with the network cut into stages.

Reproduces: ``mnist_small_batch`` (global batch 32, Nesterov momentum SGD, linear-scaled LR,
cosine decay, 10 epochs, narrow ResNet-18) trained with pipeline parallelism: the ResNet cut
into 4 stages (stem and the first two blocks; two blocks; two blocks; the last two blocks and
the classifier) on the ``stage`` axis, 2 replicas on the ``data`` axis, each replica's 16
images streamed as 4 micro-batches of 4 by the 1F1B schedule. BatchNorm normalises each
micro-batch with its statistics over the 2 replicas (8 images), as GPipe does.

Command (no download; 8 CPU devices):
    jaxdist --cpu-devices 8 train recipes/mnist_pipeline.py --workdir runs/mnist_pipeline

Hardware: any CPU; measured on 2 shared cores.
Expected: top-1 within half a point of ``mnist_small_batch``; docs/pipeline.md has the
measured result and time.
"""

from pathlib import Path

from jaxdist.run.config import load_recipe


def get_config():
    # The baseline in everything but where its layers run.
    c = load_recipe(Path(__file__).with_name("mnist_small_batch.py"))
    c.mesh = "pipeline-2x4"  # data=2 x stage=4
    c.pipeline.stages = 4
    c.pipeline.microbatches = 4
    c.pipeline.schedule = "1f1b"
    c.pipeline.boundaries = (0, 3, 5, 7)  # ResNet-18's 10 layers: stem, 8 blocks, classifier
    return c
