"""Configuration: the model's ``config.json`` (:mod:`.model`) and the ``--engram-config``
storage and topology options (:mod:`.engram`), each parsed and validated in one place."""
