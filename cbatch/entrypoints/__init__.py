"""How users reach the engine: the offline ``LLM`` class and the ``cbatch`` command line."""
