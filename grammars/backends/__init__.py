"""Mask backends behind one interface (see base.py); each is imported lazily."""
