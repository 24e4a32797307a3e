import FastdiagProofs.Basic

/-!
# Row entropy

The Shannon entropy (in nats) of a vector is `∑ i, negMulLog (p i)` where
`Real.negMulLog x = -x * log x`; since `Real.log 0 = 0` this builds in the convention
`0 log 0 = 0`.

Main results:

* `entropy_nonneg`: `0 ≤ H(p)` for a probability vector.
* `sum_negMulLog_le_log_card`: `∑_{i ∈ s} negMulLog (p i) ≤ log |s|` when `p` is a probability
  vector on the finite set `s` (Jensen's inequality for the concave `negMulLog`).
* `entropy_le_log_card`: `H(p) ≤ log n` on `n` outcomes.
* `entropy_le_log_card_of_support`: `H(p) ≤ log |S|` when `p` vanishes outside `S`
  (masked keys carry zero probability, so the bound is `log (valid keys)`).
-/

noncomputable section

namespace FastdiagProofs

variable {ι : Type*} [Fintype ι]

/-- Shannon entropy in nats, `-∑ p log p`, with `0 log 0 = 0`. -/
def entropy (p : ι → ℝ) : ℝ := ∑ i, Real.negMulLog (p i)

/-- Entropy of a probability vector is non-negative. -/
theorem entropy_nonneg {p : ι → ℝ} (hp : IsProbVec p) : 0 ≤ entropy p := by
  unfold entropy
  exact Finset.sum_nonneg fun i _ => Real.negMulLog_nonneg (hp.nonneg i) (hp.le_one i)

/-- Jensen's inequality for `negMulLog` with uniform weights: a probability vector supported on
a finite set `s` has entropy at most `log |s|`. -/
theorem sum_negMulLog_le_log_card {κ : Type*} {s : Finset κ} {p : κ → ℝ}
    (h0 : ∀ i ∈ s, 0 ≤ p i) (h1 : ∑ i ∈ s, p i = 1) :
    ∑ i ∈ s, Real.negMulLog (p i) ≤ Real.log s.card := by
  have hcard : 0 < s.card := by
    rcases Finset.eq_empty_or_nonempty s with hs | hs
    · rw [hs, Finset.sum_empty] at h1
      exact absurd h1 zero_ne_one
    · exact Finset.card_pos.mpr hs
  have hn : (0 : ℝ) < s.card := Nat.cast_pos.mpr hcard
  have hw0 : ∀ i ∈ s, (0 : ℝ) ≤ (s.card : ℝ)⁻¹ := fun _ _ => inv_nonneg.mpr hn.le
  have hw1 : ∑ _i ∈ s, (s.card : ℝ)⁻¹ = 1 := by
    rw [Finset.sum_const, nsmul_eq_mul, mul_inv_cancel₀ hn.ne']
  have hmem : ∀ i ∈ s, p i ∈ Set.Ici (0 : ℝ) := fun i hi => Set.mem_Ici.mpr (h0 i hi)
  -- Jensen: `∑ w • negMulLog (p i) ≤ negMulLog (∑ w • p i)` with `w = 1 / |s|`.
  have hJ := Real.concaveOn_negMulLog.le_map_sum hw0 hw1 hmem
  simp only [smul_eq_mul] at hJ
  rw [← Finset.mul_sum, ← Finset.mul_sum, h1, mul_one] at hJ
  have hneg : Real.negMulLog (s.card : ℝ)⁻¹ = (s.card : ℝ)⁻¹ * Real.log s.card := by
    simp only [Real.negMulLog, Real.log_inv]
    ring
  rw [hneg] at hJ
  exact le_of_mul_le_mul_left hJ (inv_pos.mpr hn)

/-- Entropy of a probability vector on `n` outcomes is at most `log n`. -/
theorem entropy_le_log_card {p : ι → ℝ} (hp : IsProbVec p) :
    entropy p ≤ Real.log (Fintype.card ι) := by
  have h := sum_negMulLog_le_log_card (s := Finset.univ) (fun i _ => hp.nonneg i)
    hp.sum_eq_one
  rw [Finset.card_univ] at h
  exact h

/-- Entropy of a probability vector that vanishes outside `S` is at most `log |S|`. -/
theorem entropy_le_log_card_of_support {p : ι → ℝ} (hp : IsProbVec p) (S : Finset ι)
    (hS : ∀ i, i ∉ S → p i = 0) : entropy p ≤ Real.log S.card := by
  have hsum : ∑ i ∈ S, p i = ∑ i, p i :=
    Finset.sum_subset (Finset.subset_univ S) fun i _ hi => hS i hi
  have hent : ∑ i ∈ S, Real.negMulLog (p i) = ∑ i, Real.negMulLog (p i) :=
    Finset.sum_subset (Finset.subset_univ S) fun i _ hi => by simp [hS i hi]
  have h := sum_negMulLog_le_log_card (s := S) (fun i _ => hp.nonneg i)
    (hsum.trans hp.sum_eq_one)
  rw [hent] at h
  exact h

/-- `0 ≤ H(p) ≤ log n` for a probability vector on `n` outcomes. -/
theorem entropy_mem_Icc {p : ι → ℝ} (hp : IsProbVec p) :
    entropy p ∈ Set.Icc 0 (Real.log (Fintype.card ι)) :=
  ⟨entropy_nonneg hp, entropy_le_log_card hp⟩

end FastdiagProofs

end
