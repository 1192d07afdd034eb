"""The steady state: what runs on every healthy step (module hooks, the step cycle, boundary reads)."""
