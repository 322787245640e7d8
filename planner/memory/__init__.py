"""Memory model: analytic model states, traced or analytic activations, GPU overheads."""
