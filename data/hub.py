"""One probe of the Hugging Face hub per process, so that a machine without network names every set that
needs the hub as unavailable at once instead of letting `datasets` retry each one for ~30 s."""

from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request

# Long enough for a slow but working connection to answer a HEAD request, short enough that an offline
# machine learns it in seconds rather than after `datasets`' own retries.
HUB_PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "true", "yes", "on")


class HubUnavailableError(RuntimeError):
    """The hub cannot be reached from here (probed once); the message says what to use instead."""


def offline_mode() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set: `datasets` then reads its local cache only, at once."""
    return any(
        os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _probe(endpoint: str, timeout: float) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:  # the server answered: reachable
        return True
    except (urllib.error.URLError, OSError):  # no route, DNS failure, timeout
        return False
    return True


@functools.cache
def hub_reachable() -> bool:
    """True when the hub answers (or offline mode defers to the local cache); asked once per process."""
    if offline_mode():
        return True
    from huggingface_hub import constants  # the endpoint, HF_ENDPOINT included

    return _probe(constants.ENDPOINT, HUB_PROBE_TIMEOUT_S)


def require_hub(what: str) -> None:
    """Raises HubUnavailableError naming `what` when the probe found no hub."""
    if not hub_reachable():
        raise HubUnavailableError(
            f"{what}: the Hugging Face hub is not reachable from here (one {HUB_PROBE_TIMEOUT_S:.0f} s probe "
            "of the endpoint). Point local_root (or SPECBLOCK_DATASETS) at local copies of the sets, or set "
            "HF_HUB_OFFLINE=1 to use the local Hugging Face cache."
        )
