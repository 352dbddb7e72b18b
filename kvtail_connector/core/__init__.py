"""What the core decides and does: the policy, the scheduler and worker sides and their
parts (``parts/``), what crosses between them (``metadata``), where the opt-in features
plug in (``extension``), the counters, and containment of the wrapper's own failures."""
