import FastdiagProofs.Cosine

/-!
# Head synchrony `s̄`

For one layer with `H` heads, head `a` has pattern `V a : ι → ℝ`.  The synchrony `s̄` is the
mean cosine over the unordered head pairs, i.e. over `a < b`.

Main results:

* `sync_nonneg`, `sync_le_one`, `sync_mem_Icc`: `0 ≤ s̄ ≤ 1` for non-negative patterns.
* `sync_eq_one_iff`: for `H ≥ 2` probability patterns, `s̄ = 1` iff all heads are equal.
* `sync_eq_one_of_forall_eq`: identical non-zero heads give `s̄ = 1`.
-/

noncomputable section

namespace FastdiagProofs

variable {ι : Type*} [Fintype ι]

/-- The head pairs `(a, b)` with `a < b`. -/
def headPairs (H : ℕ) : Finset (Fin H × Fin H) :=
  Finset.univ.filter fun p => p.1 < p.2

/-- `s̄`: mean cosine over the head pairs `a < b`. -/
def sync {H : ℕ} (V : Fin H → ι → ℝ) : ℝ :=
  (∑ p ∈ headPairs H, cosine (V p.1) (V p.2)) / (headPairs H).card

theorem mem_headPairs {H : ℕ} {a b : Fin H} : (a, b) ∈ headPairs H ↔ a < b := by
  simp [headPairs]

/-- With at least two heads there is at least one pair. -/
theorem headPairs_card_pos {H : ℕ} (hH : 2 ≤ H) : 0 < (headPairs H).card := by
  apply Finset.card_pos.mpr
  refine ⟨((⟨0, by omega⟩ : Fin H), (⟨1, by omega⟩ : Fin H)), ?_⟩
  rw [mem_headPairs]
  exact Fin.mk_lt_mk.mpr Nat.zero_lt_one

/-- `s̄ ≥ 0` for non-negative patterns. -/
theorem sync_nonneg {H : ℕ} {V : Fin H → ι → ℝ} (hV : ∀ a i, 0 ≤ V a i) : 0 ≤ sync V := by
  unfold sync
  exact div_nonneg (Finset.sum_nonneg fun p _ => cosine_nonneg (hV p.1) (hV p.2))
    (Nat.cast_nonneg _)

/-- `s̄ ≤ 1` (for any patterns). -/
theorem sync_le_one {H : ℕ} (V : Fin H → ι → ℝ) : sync V ≤ 1 := by
  unfold sync
  have h0 : (0 : ℝ) ≤ (headPairs H).card := Nat.cast_nonneg _
  rcases h0.eq_or_lt with h | h
  · rw [← h, div_zero]
    exact zero_le_one
  · rw [div_le_one h]
    calc ∑ p ∈ headPairs H, cosine (V p.1) (V p.2)
        ≤ ∑ _p ∈ headPairs H, (1 : ℝ) := Finset.sum_le_sum fun p _ => cosine_le_one _ _
      _ = (headPairs H).card := by rw [Finset.sum_const, nsmul_eq_mul, mul_one]

/-- `0 ≤ s̄ ≤ 1` for non-negative patterns. -/
theorem sync_mem_Icc {H : ℕ} {V : Fin H → ι → ℝ} (hV : ∀ a i, 0 ≤ V a i) :
    sync V ∈ Set.Icc (0 : ℝ) 1 :=
  ⟨sync_nonneg hV, sync_le_one V⟩

/-- For `H ≥ 2` heads whose patterns are probability vectors, `s̄ = 1` iff all heads have the
same pattern. -/
theorem sync_eq_one_iff {H : ℕ} (hH : 2 ≤ H) {V : Fin H → ι → ℝ}
    (hV : ∀ a, IsProbVec (V a)) : sync V = 1 ↔ ∀ a b, V a = V b := by
  have hpos : (0 : ℝ) < (headPairs H).card := Nat.cast_pos.mpr (headPairs_card_pos hH)
  have hcard : ((headPairs H).card : ℝ) = ∑ _p ∈ headPairs H, (1 : ℝ) := by
    rw [Finset.sum_const, nsmul_eq_mul, mul_one]
  have hle : ∀ p ∈ headPairs H, cosine (V p.1) (V p.2) ≤ 1 := fun p _ => cosine_le_one _ _
  unfold sync
  rw [div_eq_one_iff_eq hpos.ne', hcard, Finset.sum_eq_sum_iff_of_le hle]
  constructor
  · intro h a b
    rcases lt_trichotomy a b with hab | hab | hab
    · exact (cosine_eq_one_iff_eq (hV a) (hV b)).mp (h (a, b) (mem_headPairs.mpr hab))
    · rw [hab]
    · exact ((cosine_eq_one_iff_eq (hV b) (hV a)).mp (h (b, a) (mem_headPairs.mpr hab))).symm
  · intro h p _
    rw [h p.2 p.1]
    exact cosine_self (hV p.1).exists_ne_zero

/-- Identical non-zero patterns on `H ≥ 2` heads give `s̄ = 1` (no normalisation needed, so this
covers patterns flattened over several rows). -/
theorem sync_eq_one_of_forall_eq {H : ℕ} (hH : 2 ≤ H) {V : Fin H → ι → ℝ}
    (hne : ∀ a, ∃ i, V a i ≠ 0) (heq : ∀ a b, V a = V b) : sync V = 1 := by
  have hpos : (0 : ℝ) < (headPairs H).card := Nat.cast_pos.mpr (headPairs_card_pos hH)
  unfold sync
  rw [div_eq_one_iff_eq hpos.ne']
  calc ∑ p ∈ headPairs H, cosine (V p.1) (V p.2)
      = ∑ _p ∈ headPairs H, (1 : ℝ) :=
        Finset.sum_congr rfl fun p _ => by
          rw [heq p.2 p.1]
          exact cosine_self (hne p.1)
    _ = (headPairs H).card := by rw [Finset.sum_const, nsmul_eq_mul, mul_one]

end FastdiagProofs

end
