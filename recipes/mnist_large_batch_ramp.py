"""MNIST-5k, large batch with batch-size ramping and label smoothing (Mikami et al. in small).

Reproduces, on a CPU scale, the large-batch recipe of the ImageNet-in-minutes papers against
``mnist_small_batch``: the same model, data and number of epochs, but a global batch 16x
larger (512 instead of 32), reached by batch-size control (128 for the first two epochs,
while the learning rate warms up), label smoothing 0.1 and the linear scaling rule.
The check (issue 5): top-1 on the 1,000 held-out digits within 0.5 points of the baseline.

Command (no download; 2 CPU devices):
    jaxdist --cpu-devices 2 train recipes/mnist_large_batch_ramp.py --workdir runs/mnist_large_batch_ramp

Hardware: any CPU; measured on 2 shared cores.
Expected: see docs/training.md for the measured top-1 and time.
"""

from jaxdist.config import base_config


def get_config():
    c = base_config()
    c.model.name = "resnet18"
    c.model.stem = "small"
    c.model.width = 8
    c.data.source = "mnist5k"
    c.batch_size = 512
    c.batch_ramp = ((2, 128),)  # (until_epoch, batch): 128 per step until epoch 2, then 512
    c.num_epochs = 10.0  # the baseline's
    c.lr_base = 0.4  # LR per 256 images, as the baseline; linear scaling gives the peak
    c.lr.kind = "cosine"
    c.lr.peak = c.get_ref("lr_base") * c.get_ref("batch_size") / 256
    c.lr.warmup_epochs = 2.0
    c.label_smoothing = 0.1
    c.optimizer.name = "sgd"
    c.optimizer.weight_decay = 5e-4
    c.eval_every_epochs = 1.0
    c.eval_batch_size = 1000
    c.checkpoint.every_steps = 0
    c.log_every_steps = 10
    c.target_accuracy = 0.98
    return c
