"""MNIST-5k, small-batch baseline: the reference the large-batch recipe must match.

Reproduces: a plain small-batch run (global batch 32, Nesterov momentum SGD, linear-scaled LR
with a short warm-up, cosine decay, no label smoothing) of a narrow ResNet-18 on the 4,000
training digits of MNIST-5k (shipped inside jaxdist), evaluated on the 1,000 held-out digits.

Command (no download; 2 CPU devices):
    jaxdist --cpu-devices 2 train recipes/mnist_small_batch.py --workdir runs/mnist_small_batch

Hardware: any CPU; measured on 2 shared cores.
Expected: see docs/training.md for the measured top-1 and time.
"""

from jaxdist.run.config import base_config


def get_config():
    c = base_config()
    c.model.name = "resnet18"
    c.model.stem = "small"
    c.model.width = 8
    c.data.source = "mnist5k"
    c.batch_size = 32
    c.num_epochs = 10.0
    c.lr_base = 0.4  # LR per 256 images; the peak scales linearly with the batch
    c.lr.kind = "cosine"
    c.lr.peak = c.get_ref("lr_base") * c.get_ref("batch_size") / 256
    c.lr.warmup_epochs = 1.0
    c.optimizer.name = "sgd"
    c.optimizer.weight_decay = 5e-4
    c.eval_every_epochs = 1.0
    c.eval_batch_size = 1000
    c.checkpoint.every_steps = 0
    c.log_every_steps = 50
    c.target_accuracy = 0.98
    return c
