"""Errors of the learner: one named exception per way a fragment, a policy or a checkpoint is wrong.

Shared by the learning core (fragment, policy, PPO, checkpoints) and the training system around it
(rollout, intake, learner group); add classes, don't rename them.
"""

from shoal.errors import ShoalError


class LearnerError(ShoalError):
    """Root of the errors raised by shoal.learner."""


class BadFragment(LearnerError):
    """A trajectory fragment has a missing field, a wrong dtype or a shape that disagrees with T×N."""


class PolicyError(LearnerError):
    """A policy was built for an unsupported space, or given observations, actions or weights that don't fit it."""


class CheckpointError(LearnerError):
    """A checkpoint could not be written (disk full, no permission) or read back intact."""


class PipelineError(LearnerError):
    """A pipeline stage cannot run: no teacher for the environment, or a stage's input is unusable."""


class WeightSyncError(LearnerError):
    """A weight transfer cannot be used: a manifest that does not fit the local model, a bucket out of order, short or failing its checksum."""


class RegistrationRefused(LearnerError):
    """A rollout actor's registration cannot be taken: a malformed id or path, or a peer rank that publishes part of its weights cannot be reached."""
