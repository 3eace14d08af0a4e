"""Repository tooling: version bumps, changed-package selection and layout checks."""
