"""`loraplex rollout`: progressive delivery of adapter revisions (controller, figures, CLI)."""
