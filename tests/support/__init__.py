"""What the tests share: process helpers, meshes, fakes, references (importable as `support.X`)."""
