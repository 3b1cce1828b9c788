"""The RL algorithms, one module each behind one protocol (``base``), and the math they share: group-relative
advantages (``advantages``), the clipped policy objective (``loss``), the zero-advantage filter (``selection``)."""
