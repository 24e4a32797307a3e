import Mathlib

/-!
# Shared definitions for the fastdiag proofs

* `FastdiagProofs.IsProbVec p`: `p` is a probability vector (entries `≥ 0`, summing to `1`),
  the shape of one row of an attention pattern.
* `FastdiagProofs.mean x`: the arithmetic mean of `x : ι → ℝ` over a finite index type.

Everything is stated for an arbitrary finite index type `ι`; `Fin n` is the special case used
by `fastdiag` (keys of one row, heads of one layer, rows of one batch).
-/

noncomputable section

namespace FastdiagProofs

/-- `p` is a probability vector: non-negative entries that sum to one. -/
structure IsProbVec {ι : Type*} [Fintype ι] (p : ι → ℝ) : Prop where
  nonneg : ∀ i, 0 ≤ p i
  sum_eq_one : ∑ i, p i = 1

section ProbVec

variable {ι : Type*} [Fintype ι]

/-- Every entry of a probability vector is at most `1`. -/
theorem IsProbVec.le_one {p : ι → ℝ} (hp : IsProbVec p) (i : ι) : p i ≤ 1 :=
  calc p i ≤ ∑ j, p j := Finset.single_le_sum (fun j _ => hp.nonneg j) (Finset.mem_univ i)
    _ = 1 := hp.sum_eq_one

/-- A probability vector is not the zero vector. -/
theorem IsProbVec.exists_ne_zero {p : ι → ℝ} (hp : IsProbVec p) : ∃ i, p i ≠ 0 := by
  by_contra h
  push_neg at h
  have h0 : ∑ i, p i = 0 := Finset.sum_eq_zero fun i _ => h i
  rw [hp.sum_eq_one] at h0
  exact one_ne_zero h0

end ProbVec

section Mean

variable {ι : Type*} [Fintype ι]

/-- Arithmetic mean over a finite index type (it is `0` on an empty type). -/
def mean (x : ι → ℝ) : ℝ := (Fintype.card ι : ℝ)⁻¹ * ∑ i, x i

/-- The mean of a constant is that constant. -/
theorem mean_const [Nonempty ι] (c : ℝ) : mean (fun _ : ι => c) = c := by
  have hc : (0 : ℝ) < Fintype.card ι := Nat.cast_pos.mpr Fintype.card_pos
  show (Fintype.card ι : ℝ)⁻¹ * ∑ _i : ι, c = c
  rw [Finset.sum_const, Finset.card_univ, nsmul_eq_mul, inv_mul_cancel_left₀ hc.ne']

/-- The mean is monotone. -/
theorem mean_mono {x y : ι → ℝ} (h : ∀ i, x i ≤ y i) : mean x ≤ mean y := by
  unfold mean
  exact mul_le_mul_of_nonneg_left (Finset.sum_le_sum fun i _ => h i)
    (inv_nonneg.mpr (Nat.cast_nonneg _))

/-- A lower bound on every value is a lower bound on the mean. -/
theorem le_mean [Nonempty ι] {x : ι → ℝ} {a : ℝ} (h : ∀ i, a ≤ x i) : a ≤ mean x :=
  calc a = mean (fun _ : ι => a) := (mean_const a).symm
    _ ≤ mean x := mean_mono h

/-- An upper bound on every value is an upper bound on the mean. -/
theorem mean_le [Nonempty ι] {x : ι → ℝ} {b : ℝ} (h : ∀ i, x i ≤ b) : mean x ≤ b :=
  calc mean x ≤ mean (fun _ : ι => b) := mean_mono h
    _ = b := mean_const b

/-- Deviations from the mean sum to zero. -/
theorem sum_sub_mean [Nonempty ι] (x : ι → ℝ) : ∑ i, (x i - mean x) = 0 := by
  have hc : (0 : ℝ) < Fintype.card ι := Nat.cast_pos.mpr Fintype.card_pos
  rw [Finset.sum_sub_distrib, Finset.sum_const, Finset.card_univ, nsmul_eq_mul, mean,
    mul_inv_cancel_left₀ hc.ne', sub_self]

end Mean

end FastdiagProofs

end
