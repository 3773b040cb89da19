"""The engine core: requests and their blocks (``sequence``, ``block_manager``,
``scheduler``: plain Python, no torch), then the step on the device (``model_runner``,
``sampler``) and the loop that ties them together (``engine``)."""
