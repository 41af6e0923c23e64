"""The loss of a flax linen classifier, as a train step takes it."""

from __future__ import annotations

import jax.numpy as jnp

from jaxdist.training import optim
from jaxdist.training.protocol import LossFn

__all__ = ["classifier_loss"]


def classifier_loss(model, *, num_classes: int, label_smoothing: float = 0.0) -> LossFn:
    """``loss_fn`` for a flax linen classifier taking ``(images, train=...)`` with BatchNorm
    state in the ``batch_stats`` collection; batches are ``{"image", "label"}`` dicts."""

    def loss_fn(params, model_state, batch, rng):
        variables = {"params": params, **model_state}
        logits, new_state = model.apply(
            variables, batch["image"], train=True, mutable=list(model_state), rngs={"dropout": rng}
        )
        loss = optim.smoothed_cross_entropy(
            logits, batch["label"], num_classes, label_smoothing
        ).mean()
        accuracy = (jnp.argmax(logits, -1) == batch["label"]).mean()
        return loss, (new_state, {"accuracy": accuracy})

    return loss_fn
