"""The code between the watched models' calls (loss, data, update code): recorded as it runs, run again at an event."""
