"""ResNet-50 on ImageNet with the flax ``examples/imagenet`` defaults, as a comparison point.

Reproduces: the flax example's TPU configuration -- batch 1,024, LR 0.1 x B/256 = 0.4,
5 warm-up epochs then cosine decay over 100 epochs, Nesterov momentum 0.9, weight decay 1e-4
on parameters with ndim > 1, BatchNorm (momentum 0.9, eps 1e-5) synchronised across all
devices, zero-initialised last BN scale, bf16 compute. Flax reports 76.5% top-1 on a TPU
v3-32 in 2.1 hours (8 x V100 with mixed precision: 4.3 hours).

Command (any number of devices that divides 1,024):
    jaxdist train recipes/resnet50_imagenet_flax.py --set data.root=/data/imagenet

CPU smoke run:
    jaxdist --cpu-devices 8 train recipes/resnet50_imagenet_flax.py --set data.source=synthetic \
      --set data.image_size=32 --set model.width=8 --set batch_size=16 --set max_steps=3

Hardware: TPU v3-32 or 8 GPUs. Expected: 76.5% top-1 after 100 epochs; not measured here.
"""

from jaxdist.run.imagenet import imagenet


def get_config():
    c = imagenet()
    c.batch_size = 1024
    c.num_epochs = 100.0
    c.lr_base = 0.1
    c.lr.peak = c.get_ref("lr_base") * c.get_ref("batch_size") / 256
    c.eval_batch_size = 1024
    c.target_accuracy = 0.765
    return c
