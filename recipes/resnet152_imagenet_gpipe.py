"""ResNet-152 on ImageNet with GPipe-style pipeline parallelism: 4 stages x 2 replicas.

Reproduces: the GPipe recipe for a deep convolutional network (Huang et al. 2019): the
network cut into 4 stages of about equal compute, each data-parallel replica's batch streamed
through them as 8 micro-batches, every forward then every backward (GPipe's schedule), one
synchronous update, BatchNorm statistics per micro-batch. Training follows Goyal et al.:
SGD with Nesterov momentum 0.9, LR 0.1 per 256 images with a 5-epoch warm-up, cosine decay,
weight decay 1e-4, 90 epochs, bf16 compute.

ResNet-152 has 52 layers as the pipeline counts them (the stem, 50 bottleneck blocks, the
classifier). A bottleneck block costs about the same at every resolution (the width doubles as
the side halves), so 13 layers per stage balances compute; the later stages hold more
parameters (their blocks are wider).

Command (8 accelerators):
    jaxdist train recipes/resnet152_imagenet_gpipe.py --workdir runs/resnet152_gpipe \\
        --set data.root=/data/imagenet
CPU smoke run (tiny synthetic images, 8 forced devices):
    jaxdist --cpu-devices 8 train recipes/resnet152_imagenet_gpipe.py --workdir /tmp/r152 \\
        --set data.source=synthetic --set data.image_size=32 --set model.width=8 \\
        --set model.dtype=float32 --set batch_size=16 --set pipeline.microbatches=2 \\
        --set eval_batch_size=16 --set max_steps=2

Hardware: 8 GPUs (one host) or 8 TPU chips; the mesh is ``pipeline-2x4``.
Expected: the published ResNet-152 top-1 of about 78% after 90 epochs; docs/pipeline.md
says what was measured here.
"""

from jaxdist.run.imagenet import imagenet


def get_config():
    c = imagenet("resnet152")
    c.mesh = "pipeline-2x4"
    c.pipeline.stages = 4
    c.pipeline.microbatches = 8
    c.pipeline.schedule = "gpipe"
    c.pipeline.boundaries = (0, 13, 26, 39)
    c.batch_size = 256
    c.lr_base = 0.1  # per 256 images
    c.lr.peak = c.get_ref("lr_base") * c.get_ref("batch_size") / 256
    c.eval_batch_size = 256
    c.target_accuracy = 0.78
    return c
