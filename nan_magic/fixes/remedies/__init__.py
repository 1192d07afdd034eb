"""The remedies a fix trial can make, one module each: where it applies, how it changes the step, the edit it says.

``domain`` (an eps into a log, sqrt, pow, a division, acos, asin, atanh, logit), ``stable`` (a max-subtracted exp, a
fused log-softmax), ``mask`` (a fully masked softmax row), ``precision`` (float32), ``scale`` (a lower GradScaler
scale), ``batch`` (the step without its bad samples) and ``data_code`` (the loop's data code remedied), ``diverged``
and ``optimizer_step`` (an update redone at a tenth of its learning rate, an Adam eps). fixes/runner.py picks and
runs them on replays of the failing step (fixes/step.py).
"""
