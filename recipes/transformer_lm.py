"""A byte-level transformer language model on the Python standard library's sources.

Reproduces: the measured run of docs/tasks.md. A 2-layer decoder-only transformer written in
flax NNX (d_model 128, 4 heads, context 128 bytes) learns to predict the next byte of the
running Python's own ``.py`` files, one file in twenty (by path checksum) held out. It is
evaluated by held-out bits per byte beside the baseline a model without context gets from the
training bytes' frequencies (about 4.7 bits per byte).

Command (no download; 2 CPU devices, any allreduce):
    jaxdist --cpu-devices 2 train recipes/transformer_lm.py --workdir runs/transformer_lm
    jaxdist --cpu-devices 2 train recipes/transformer_lm.py --set allreduce=halving_doubling
    jaxdist --cpu-devices 2 train recipes/transformer_lm.py --set pipeline.stages=2 \
        --set pipeline.schedule=1f1b --set pipeline.microbatches=4   # data=1 x stage=2
    jaxdist --cpu-devices 8 train recipes/transformer_lm.py --set sharding=fsdp   # FSDP over 8

Hardware: any CPU; about 2 minutes on 2 shared cores.
Expected: see docs/tasks.md for the measured bits per byte and time.
"""

from jaxdist.run.config import base_config
from jaxdist.tasks.language_model import LanguageModel, data_fields, model_fields


def get_config():
    c = base_config()
    c.model = model_fields()
    # As MaxText trains: the blocks scanned (one compiled block, whatever the depth) and
    # recomputed in backward (each keeps only its input), so a deep model fits where a plain
    # jit of it fits; a pipeline's stages unscan them (the note says so).
    c.model.scan_layers = True
    c.model.remat = "full"
    c.data = data_fields()
    c.data.max_train_bytes = 2 * 2**20  # the first 2 MiB of the training files
    c.data.max_eval_bytes = 256 * 2**10
    c.allreduce = "ring"
    c.bucket_bytes = 256 * 2**10
    c.batch_size = 32
    c.num_epochs = 1.0
    c.optimizer.name = "adamw"
    c.optimizer.eps = 1e-8
    c.optimizer.b2 = 0.98
    c.optimizer.weight_decay = 0.01
    c.lr.kind = "cosine"
    c.lr.peak = 2e-3
    c.lr.warmup_epochs = 0.05
    c.eval_every_epochs = 0.5
    c.eval_batch_size = 128
    c.checkpoint.every_steps = 200
    c.log_every_steps = 50
    c.target_accuracy = 3.2  # bits per byte on the held-out files
    return c


def get_task(config, replicas):
    return LanguageModel(config, replicas)
