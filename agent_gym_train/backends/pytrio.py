"""The remote backend: pytrio's own ``ServiceClient``, used exactly as the local one.

Nothing is wrapped: trainers call ``create_lora_training_client``, ``forward_backward``,
``optim_step``, ``save_weights_and_get_sampling_client``, ``sample_async``, ``save_state``
and ``create_training_client_from_state_with_optimizer`` on whichever service they are
given, so a trainer tested offline on ``LocalServiceClient`` runs unchanged here.
"""

from __future__ import annotations

import pytrio


class BackendError(RuntimeError):
    """The remote service could not be reached or refused the credentials."""


def connect(api_key: str | None = None) -> pytrio.ServiceClient:
    """Authenticate (key argument, else the environment or the ``pytrio`` CLI profile)."""
    try:
        return pytrio.ServiceClient(api_key=api_key)
    except pytrio.PyTrioError as err:
        raise BackendError(
            f"cannot start a pytrio session ({err}); pass an API key or log in with the "
            "pytrio CLI, or use the local backend"
        ) from err
