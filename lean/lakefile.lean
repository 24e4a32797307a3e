import Lake
open Lake DSL

/-!
Lake project for the machine-checkable proofs behind `fastdiag`'s diagnostics.

The Lean toolchain is pinned in `lean-toolchain` (leanprover/lean4:v4.15.0) and Mathlib is
pinned below to the tag built for that toolchain, so `lake exe cache get` can fetch
prebuilt Mathlib oleans.
-/

package «FastdiagProofs» where
  leanOptions := #[
    ⟨`autoImplicit, false⟩,
    ⟨`relaxedAutoImplicit, false⟩
  ]

require mathlib from git
  "https://github.com/leanprover-community/mathlib4" @ "v4.15.0"

@[default_target]
lean_lib «FastdiagProofs» where
  roots := #[`FastdiagProofs]
