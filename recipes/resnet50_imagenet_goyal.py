"""ResNet-50 on ImageNet with an 8K batch: Goyal et al. 2017, "Accurate, Large Minibatch SGD".

Reproduces: 76.3% top-1 in 1 hour on 256 P100 with batch 8,192 (32 images per GPU):
linear scaling of the learning rate (0.1 x 8,192 / 256 = 3.2), 5-epoch gradual warm-up from
0.1, then x0.1 at epochs 30, 60 and 80 of 90; momentum 0.9, weight decay 1e-4 (not on BN
parameters or biases); BatchNorm statistics per worker over its 32 images
(``model.bn_group_size = 1``); the last BN scale of each residual block initialised to zero.

Command (256 devices, e.g. 32 hosts of 8 GPUs):
    jaxdist train recipes/resnet50_imagenet_goyal.py --set data.root=/data/imagenet

CPU smoke run (tiny synthetic images, 8 forced devices, 4 images per device):
    jaxdist --cpu-devices 8 train recipes/resnet50_imagenet_goyal.py --set data.source=synthetic \
      --set data.image_size=32 --set model.width=8 --set batch_size=32 --set max_steps=3

Hardware: 256 GPUs (the paper: P100; any 256 devices with 32 images each). Expected: 76.3%
top-1 after 90 epochs; about 1 hour on 256 P100 per the paper, not measured here.
"""

from jaxdist.run.imagenet import imagenet


def get_config():
    c = imagenet()
    c.model.dtype = "float32"  # the paper trained in float32
    c.model.bn_group_size = 1  # per-worker BN: statistics over each device's 32 images
    c.batch_size = 8192
    c.max_per_device_batch = 32
    c.optimizer.nesterov = False
    c.lr_base = 0.1
    c.lr.kind = "step"
    c.lr.peak = c.get_ref("lr_base") * c.get_ref("batch_size") / 256  # linear scaling
    c.lr.init_lr = 0.1  # gradual warm-up from the small-batch LR
    c.lr.step_epochs = (30.0, 60.0, 80.0)
    c.lr.step_factor = 0.1
    c.eval_batch_size = 256 * 32
    c.target_accuracy = 0.763
    return c
