"""Cases built from a framework's own model and parallelism code (`transformers_case`, ...)."""
