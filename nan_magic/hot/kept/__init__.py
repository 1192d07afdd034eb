"""What a step keeps: the records its hooks append, and the state a replay needs (used only at an event).

call_records (a module call, each tensor's probe, a pass-through's alias; a call's Frame on the
module stack), step_log (the step's calls in order, probes read in one transfer, consumers
found), finding (an event's working note, from detection to Report), held (a call's arguments,
kept for a replay), rng (the RNG and autocast state a call ran in), saved_hooks (the saved-tensor hooks it
ran under) and buffer_copies (the buffers a call may change, copied before it for a step replay).
"""
