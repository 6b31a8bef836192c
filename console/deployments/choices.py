from django.db import models


class DeploymentState(models.TextChoices):
    """Lifecycle of a deployment (transitions in ``services.deployment_transition``)."""

    # Configured, nothing started.
    DRAFT = "draft", "Draft"
    # The deployment workflow is bringing it up (or re-deploying it).
    DEPLOYING = "deploying", "Deploying"
    # Serving traffic.
    ACTIVE = "active", "Active"
    # The last deployment workflow failed; may be retried.
    FAILED = "failed", "Failed"
    # Taken out of service for good; kept for its history.
    RETIRED = "retired", "Retired"


# Allowed transitions: from -> set of to.
STATE_TRANSITIONS: dict[str, frozenset[str]] = {
    DeploymentState.DRAFT: frozenset({DeploymentState.DEPLOYING, DeploymentState.RETIRED}),
    DeploymentState.DEPLOYING: frozenset(
        {DeploymentState.ACTIVE, DeploymentState.FAILED, DeploymentState.RETIRED}
    ),
    DeploymentState.ACTIVE: frozenset({DeploymentState.DEPLOYING, DeploymentState.RETIRED}),
    DeploymentState.FAILED: frozenset({DeploymentState.DEPLOYING, DeploymentState.RETIRED}),
    DeploymentState.RETIRED: frozenset(),
}


class PoolRole(models.TextChoices):
    """What a pool's engines do."""

    # Local decode engines (also the local-prefill fallback).
    DECODE = "decode", "Decode"
    # Remote prefill engines.
    PREFILL = "prefill", "Prefill"


class Compression(models.TextChoices):
    """KV transfer compression, per chunk."""

    # Raw bytes.
    NONE = "none", "None"
    # zstd on the raw bytes.
    ZSTD = "zstd", "zstd"
    # zstd after splitting 16-bit values into byte planes (better ratio on bf16).
    ZSTD_BYTEPLANE = "zstd-byteplane", "zstd (byte planes)"
    # Chosen per link from measured link rate and codec speed.
    AUTO = "auto", "Auto"


class KvMode(models.TextChoices):
    """How the gateway's remote legs hand the KV over (``kv_transfer.mode``)."""

    # pdbridge's engines: both legs at once; the prefill engine pushes to the decode node's
    # KV receiver under a transfer id the gateway chose.
    PUSH = "push", "Push (pdbridge engines)"
    # vLLM's built-in connectors (NixlConnector, ...): the prefill leg first; its answer's
    # kv_transfer_params go to the decode leg, whose engine fetches the KV.
    PULL = "pull", "Pull (vLLM connectors)"
