"""Bundled configs of ``pepo_recipe`` (found by name: ``--config tiny``)."""
