"""The sentences of why a fix was not tried: a trial's reason (:class:`~nan_magic.fix_records.FixTrial`'s
``reason``), and a report's note where no trial ran at all.

A reason is a :class:`~nan_magic.note_records.Note`: the fix trials (nan_magic/fixes/) keep its kind and the
plain values it rests on; the words are all here, merged into note_words.py's tables, so ``FixTrial.untried``
and a note that holds a reason (``fixes-no-loss-code``'s) read the same. A reason that says why another thing
failed holds that reason's note as its ``reason`` fact (a pair), filled in by note_words.py.
"""

from __future__ import annotations

from collections.abc import Callable

from nan_magic.note_records import Note

__all__ = ["FIX_REASON_TEMPLATES", "FIX_REASON_WRITERS", "reason_words"]

_CANNOT_TELL = "the trial cannot tell"
_NO_UPDATE = "there is no update to redo"

#: The reasons whose words are their facts filled into a template.
FIX_REASON_TEMPLATES: dict[str, str] = {
    # fixes/runner.py: a report's note where no fix was tried at all
    "fixes-per-call": "no fix was tried: with replay=False a watch that checks every module call keeps no model "
                      "call of the step to try one on",
    "fixes-traced": "no fix was tried: with replay=False a watch that traces every op keeps no model call of the "
                    "step to try one on",
    "fixes-not-reproduced": "no fix was tried: the failing step, run again on copies as it ran, came out finite, so "
                            "no remedy could be judged on it",
    "fixes-not-reproduced-graph-grad": "no fix was tried: the failing step, run again on copies, came out finite: "
                                       "the loss code's own torch.autograd.grad(create_graph=True) was run again as "
                                       "the ops it recorded, on the tensors the model's forward had saved, so the "
                                       "copies' gradients miss that derivative's part and no remedy could be judged",
    "fixes-replay-raised": "no fix was tried: the failing step, run again on copies as it ran, raised {error}",
    "fixes-no-loss-code": "no fix was tried: the producer ran in the loss code, which the trials could not run "
                          "again: {reason}",
    "fixes-no-data-code": "no fix was tried: the producer ran in code that built the data (a target, an input), "
                          "which the trials could not run again: {reason}",
    "fixes-no-call": "no fix was tried: no model call of the failing step was kept to run again",
    "fixes-none-fit": "no fix was tried: the producer's op ({op}) is not one a remedy changes at its line (the "
                      "trials change a log, log1p, sqrt, rsqrt, pow, division, acos, asin, atanh or logit, an exp, a "
                      "softmax, a std or variance of one element, a line in half precision)",
    "fixes-batch-unsliced": "no fix was tried: the non-finite values entered the model in a numpy array, a list of "
                            "Python numbers or an object's attributes, whose samples skip-batch cannot leave out; drop "
                            "them where the batch is made",
    "fixes-batch-outside": "no fix was tried: the non-finite values did not enter through a model call's arguments "
                           "(the loop's code read them, or a gradient given to backward held them), and skip-batch "
                           "leaves samples out of a model call's batch only",
    "fixes-optimizer-none": "no fix was tried: the producer ran in the {optimizer} step, whose trials redo it at a "
                            "tenth of its learning rate or with an Adam eps its dtype holds, neither the remedy of "
                            "a {cause}",
    "fixes-optimizer-overflow": "no fix was tried: the trials of the {optimizer} step (a tenth of its learning rate, "
                                "a larger eps) leave its gradient as large as it was, and clipping it is not one of "
                                "them",
    "fixes-update-code": "no fix was tried: the producer ({op}) ran in the loop's code between backward() and the "
                         "step, which the trials do not run again",
    "fixes-update-divisor": "no fix was tried: the producer ({op}) ran in the loop's code between backward() and the "
                            "step, which the trials do not run again (they replay the step's forward, loss and "
                            "backward only); an eps in its divisor at that line (norm.clamp_min(eps), or norm + eps) "
                            "is the likely remedy, not verified",
    "fixes-after-step-code": "no fix was tried: the producer ({op}) ran in the loop's code after the optimizer "
                             "step, which the trials do not run again (they replay the step's forward, loss and "
                             "backward, and redo an optimizer step); the remedy the likely cause names, at that "
                             "line, is not verified",
    "fixes-call-running": "no fix was tried: the failing model call's arguments could not be read while it ran",
    "fixes-failed": "the fix trials failed ({error}); no remedy was tried",
    "fixes-interrupted": "the fix trials were interrupted (the stop button, Ctrl-C): no remedy was tried; the rest "
                         "of the report is as found",
    "needs-ranks": "no fix was tried under a process group of {ranks:~rank}: {reason}, and the other ranks are not "
                   "replaying",
    "ranks-sharded": "the model is sharded by FSDP (its forward gathers parameters from every rank)",
    "ranks-sync-batchnorm": "a SyncBatchNorm in training mode syncs its statistics across ranks",
    "ranks-optimizer": "the {optimizer} optimizer communicates across ranks",
    "ranks-collective": "the loss code runs a collective ({op})",
    # fixes/runner.py: a trial not run, or its verdict not counted
    "time-budget": "the time budget ({seconds:.2g} s) was spent",
    "nothing-to-change": "it found nothing to change at the producer's line",
    "loss-code-not-rerun": "the loss code could not be run again: {reason}",
    "no-loss-code-recorded": "none was recorded",
    "scale-at-most-one": "the scale ({scale:g}) is 1 or less: there is no lower one to try",
    "optimizer-not-rebuilt": "the optimizer could not be rebuilt on copies ({problem})",
    "lr-not-finite": "the learning rate is {lr}: a tenth of it is too",
    "sparse-batch": "the non-finite values are in a sparse tensor (a graph's adjacency), whose rows are no samples "
                    "to leave out",
    "no-sample-left-out": "no sample could be left out: every one, or none along the batch's first dimension, "
                          "holds the non-finite value",
    # fixes/loss.py: why the step's loss code cannot be run on a trial's outputs
    "ops-mode-loss-code": "ops mode traces the loss code as it runs, and keeps no record of it to run again (a "
                          "watch without the op tracer records it, so that its trials can run it again)",
    "loss-code-untraced": "the loss code ran more ops a step than the watch records",
    "no-earlier-backward": "the forward failed before this step's loss code ran, and no earlier step ran "
                           "backward() watched",
    "backward-not-from-tensor": "the backward did not start at Tensor.backward(), so its loss is not known",
    "last-loss-code-not-kept": "the forward failed before this step's loss code ran, and the last step's is kept "
                               "only with keep_last_good",
    "last-loss-not-recorded": "the forward failed before this step's loss code ran, and the last step's loss was "
                              "not made by the code recorded after its model call",
    "loss-not-recorded": "the tensor backward() started from was not made by the code recorded after the model call",
    "loss-input-not-recorded": "the non-finite value the loss code read was not made by the code the watch recorded",
    "loss-input-random": "the code that made the non-finite value the loss code read draws random numbers",
    "loss-input-finite": "the loss code read no non-finite value that the loop's code made before the model call",
    "another-model-nonfinite": "the loss code read the non-finite output of another model's call ({model}), which "
                               "the trial does not replay on its outputs",
    "loss-reads-no-output": "the loss code read no output of the model call the trial replays",
    "outputs-unknown": "the last step's loss code read {grads} tensors that required gradients, and the model call "
                       "returned {paths}: which output each was is not known",
    "other-outputs": "the replayed model returned other outputs than the loss code read",
    "loss-input-freed": "a tensor the loss code read was freed (only small ones are kept past backward())",
    "loss-code-raised": "the loss code raised {error} on the replayed outputs",
    "loss-not-scalar": "backward() started from a tensor that is not a scalar loss",
    # fixes/loss.py unjudged: the trial ran, but its verdict says nothing of the user's step
    "deliberate-infinities": "the remedied outputs keep the model's deliberate infinities (a mask's -inf) and the "
                             "step's loss code did not run on them, the backward started from a stand-in: whether "
                             f"the loss stays finite, {_CANNOT_TELL}",
    "loss-code-differentiates": "the loss came out non-finite, but the loss code differentiates "
                                "(torch.autograd.grad) and its recorded backward runs as it ran, the unremedied "
                                f"line's derivative: {_CANNOT_TELL}",
    "hand-backward": "the loss code calls {function}, a custom autograd.Function: the trial runs again the ops its "
                     "forward ran, whose derivative is torch's, not {function}.backward's, so its backward is not "
                     f"the step's: {_CANNOT_TELL}",
    # fixes/remedies/stable.py: a fused form declined, or a max-subtracted exp that computes another value
    "exp-scaled-nonfinite": "it changes what the line computes: with the exp multiplied by 8 or 16 the step was "
                            "non-finite (the max does not cancel out of what the line's exp computes, as it does out "
                            "of a softmax)",
    # fixes/remedies/diverged.py, optimizer_step.py: an optimizer step redone from the last good state
    "no-last-good-state": "no last good state was kept (%%nantrace --keep-last-good, %nanwatch on "
                          "--keep-last-good or watch(..., keep_last_good=True) keeps the state the step is redone "
                          "from)",
    "first-optimizer-step": "it is the first optimizer step: no state before it is kept to redo it from",
    "no-optimizer-stepping": f"no optimizer of the model was seen stepping: {_NO_UPDATE}",
    "update-not-linear": "a {optimizer} update is not its learning rate times a step that does not depend on it",
    "no-state-before-update": "no state was kept after step {step}, before the previous update (fewer than two "
                              f"optimizer steps ended finite): {_NO_UPDATE}",
    "kept-state-lacks": "the state kept after step {step} does not hold {parameter}",
    "gradients-overwritten": "the gradients of step {step} are gone: the step was judged at step {judged}, whose "
                             "backward wrote non-finite ones over them (made from the non-finite parameters; a "
                             "watch with defer=False judges each step at once and keeps them)",
    "no-finite-step-before": "no optimizer step ended finite before this one: there is no state to redo it from",
    "redo-not-reproduced": "the step redone from the last good state as it ran came out finite: the redo does not "
                           "reproduce it",
    # fixes/remedies/data_code.py: the batch made again by the recorded data code
    "batch-not-recorded": "the non-finite batch was not made by the data code the watch recorded",
    "batch-written-in-place": "the data code wrote the batch in place, and its value before that write is not kept",
    "data-input-freed": "a tensor the data code read was freed since",
}

#: The fused forms' log taken apart: what the line takes the log of (fixes/remedies/stable.py's forms).
_LOGGED = {"log_softmax": "softmax", "logsigmoid": "sigmoid", "logsigmoid(-x)": "1 - sigmoid(x)",
           "log_ndtr": "normal CDF", "softplus": "1 + exp(x)", "logdet": "determinant"}


def _fused_declined(note: Note) -> str:
    form = note.fact("form") or "the fused form"
    logged = _LOGGED.get(form, "value")
    if note.fact("why") == "written":
        return (f"the {logged} the line takes the log of (or its input) was written in place after it was "
                f"computed, so {form} of its input is no longer the line's value: fusing it would change what the "
                "line computes")
    return (f"{form} of the {logged}'s input is not the line's own value where that is finite: fusing it would "
            "change what the line computes")


def _max_does_not_cancel(note: Note) -> str:
    moved, name = note.fact("moved"), note.fact("name")
    what = {"output": "model's output" if name == "output" else f"model's output {name}",
            "buffer": f"buffer {name}"}.get(moved, moved)
    where = ("in at least one of the modules that run the line (an edit of it changes each one's use; the max "
             "cancels only out of an exp normalised by its own sum, as a softmax's is)" if note.fact("every") else
             "(the exp is not normalised by its own sum, as a softmax's is)")
    return (f"it changes what the line computes: exp(x - max) is exp(x) / exp(max), and the max does not cancel "
            f"here {where}: with the exp multiplied by 8 or 16 the {what} moved by {note.fact('change'):.3g}; a log "
            "of the exp's sum needs the max added back (torch.logsumexp), a ratio or a scale has no max to take "
            "out: clamp the exponent")


def _weight_decay_too_high(note: Note) -> str:
    decay = note.fact("decay")  # (lr * weight_decay at a tenth of the learning rate)
    return (f"at a tenth of the learning rate, lr * weight_decay is still {decay:g}: the decay alone multiplies each "
            f"parameter by {1 - decay:g} a step, and the run diverges again (the weight decay is the setting to "
            "lower)")


def _float32_refused(note: Note) -> str:
    return (f"the code after the producer's line refused its float32 result ({note.fact('error')}: "
            f"{note.fact('message')}): it meets tensors still in {note.fact('dtype') or 'half precision'} there, so "
            "the line cannot be computed in float32 alone; that code would need float32 too (or autocast over the "
            "region)")


#: The reasons whose words depend on their facts beyond filling them in.
FIX_REASON_WRITERS: dict[str, Callable[[Note], str]] = {
    "fused-declined": _fused_declined,
    "max-does-not-cancel": _max_does_not_cancel,
    "weight-decay-too-high": _weight_decay_too_high,
    "float32-refused": _float32_refused,
}


def reason_words(value: object) -> str | None:
    """The words of a reason kept as a fact (a trial's ``loss_not_computed``): its note's pair; a scene written
    before reasons were data kept the sentence itself, shown as it was."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return Note.from_pair(value).text
    return None if value is None else str(value)
