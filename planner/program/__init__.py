"""The training program as traced: the step the Trainer runs, its CUDA rules (autocast, dropout, attention kernel),
the fake-tensor trace with its live-storage tracker, the op profile and the compiled graph. Memory and speed both
read what this package records."""
